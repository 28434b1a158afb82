"""The KV tiers below the device pool: the host-RAM tier (`host/`), the disk tier (`disk/`), the
copies between device blocks and payloads, and `KVTiers`, the one interface the engine calls.

Imported by the engine only (and `stats.py`, a leaf of plain records, by the API); imports the
cache, the model's KV layout and the leaves. Nothing is imported here, so `tiers.stats` stays
light.
"""
