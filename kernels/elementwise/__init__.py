"""Per-token ops: RMSNorm (with residual add) and rotary embedding (Triton launchers and torch
references), the gated MLP's activation (torch), and each in one native CPU pass
(`elementwise_cpu`)."""
