"""Read a GGUF file (llama.cpp's format): architecture metadata and dequantized tensors.

The reader (gguf-py's) memory-maps the file; tensors are dequantized one at a time. Its metadata
is parsed once per file a process opens: a second engine on the same file reuses the parsed
reader, which is read-only (the file is mapped with mode "r"). Arrays (a vocabulary, its merges
and token types) are parsed in one loop each where gguf-py recurses once per entry (SmolLM2's
150k entries: 4 s), into the same fields.

llama.cpp's converter permutes the rows of Llama Q and K projections for its interleaved RoPE;
this loader undoes that permutation so the model's rotate-half RoPE applies (the wrong pairing
still gives plausible text but far worse perplexity).
"""

from __future__ import annotations

import functools
import mmap
import warnings
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from deepinfer.errors import ModelLoadError
from deepinfer.kernels.linear.quant_matmul import QuantFormat, QuantizedWeight, dequantize
from deepinfer.model.arch import ModelArch
from deepinfer.model.loading.gguf_mla import MLA_LAYER_NAMES, joined_kv_b, mla_fields
from deepinfer.model.loading.gguf_moe import EXPERT_STACKS, MOE_LAYER_NAMES, moe_fields
from deepinfer.model.loading.gguf_repack import q4_0_as_q4_1, q5_0_as_q8_0
from deepinfer.model.registry import check_architecture

GGUF_MAGIC = b"GGUF"
_KERNEL_FORMATS = {
    "Q4_0": QuantFormat.Q4_1,
    "Q4_1": QuantFormat.Q4_1,
    "Q5_0": QuantFormat.Q8_0,
    "Q8_0": QuantFormat.Q8_0,
    "Q4_K": QuantFormat.Q4_K,
    "Q5_K": QuantFormat.Q5_K,
    "Q6_K": QuantFormat.Q6_K,
}
"""GGUF tensor types the native quantized matmul takes: Q4_1, Q8_0 and the K-quants as they
are, Q4_0 as the Q4_1 blocks of the same values (`q4_0_as_q4_1`), Q5_0 as the Q8_0 blocks of
the same values (`q5_0_as_q8_0`)."""
KERNEL_FORMAT_NAMES = tuple(_KERNEL_FORMATS)
"""The GGUF types served in their blocks, for messages."""
_FLOAT_TYPES = ("F32", "F16", "BF16")
_REPACKED = {"Q4_0": q4_0_as_q4_1, "Q5_0": q5_0_as_q8_0}
"""The GGUF types served as blocks of another format, and how (None: not this matrix)."""


_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **MOE_LAYER_NAMES,
    **MLA_LAYER_NAMES,
}
_GGUF_ARCHS = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v3"}
"""llama.cpp's architecture names served under another registry key (and Mixtral is llama.cpp's
`llama` with experts)."""
_PERMUTED_QK = ("llama", "mixtral")
"""Architectures whose Q and K rows llama.cpp's converter permutes."""


_SANDWICH_NORM_NAMES = _LAYER_NAMES | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
"""Gemma 3's four norms a layer: its `ffn_norm` is the one before the FFN, not Llama's second."""


def canonical_name(gguf_name: str, architecture: str = "llama") -> str:
    """GGUF tensor name -> canonical (HF-style) name; unknown names come back unchanged."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _SANDWICH_NORM_NAMES if architecture == "gemma3" else _LAYER_NAMES
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"layers.{parts[1]}.{names[parts[2]]}"
    return gguf_name


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open and parse a GGUF file; raise ModelLoadError if it is not one, or is truncated."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path} is not a GGUF file (starts with {magic!r}); pass a .gguf file or a "
            "Hugging Face directory with config.json and *.safetensors"
        )
    st = path.stat()
    try:
        reader = _parsed(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    except Exception as exc:  # the reader fails in many ways on corrupt input
        raise ModelLoadError(f"{path} is a corrupt or truncated GGUF file: {exc}") from exc
    size = st.st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(
            f"{path} is truncated: tensor data ends at byte {end}, file has {size}"
        )
    return reader


def release_mapped_pages(reader: gguf.GGUFReader) -> None:
    """Drop this process's resident pages of the file's mapping once the model holds copies of
    what it serves: read pages count in the server's RSS (the whole file, once loaded) until the
    kernel reclaims them. The mapping is read-only, so nothing is lost: a later read (the
    tokenizer's metadata) faults its pages back in from the file."""
    mapped = getattr(reader.data, "_mmap", None)  # numpy's memmap keeps its mmap object there
    if isinstance(mapped, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)


@functools.lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime_ns: int, inode: int) -> gguf.GGUFReader:
    """The file's reader, parsed once per identity (a file rewritten in place is parsed anew)."""
    del size, mtime_ns, inode  # part of the cache key only
    return Reader(path, "r")


class Reader(gguf.GGUFReader):
    """gguf-py's reader with one faster path: an array of strings or of scalars is read in one
    loop over a plain view of the mapped file, into the parts, indices and types gguf-py's own
    recursion gives it (a numpy memmap slice runs Python code; tests compare every field)."""

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list[gguf.GGUFValueType]]:
        if raw_type != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        kind = gguf.GGUFValueType(int(item_type[0]))
        scalar = self.gguf_scalar_to_np.get(kind)
        if kind != gguf.GGUFValueType.STRING and scalar is None:  # nested arrays
            return super()._get_field_parts(orig_offs, raw_type)
        n, data, offs = int(count[0]), self.data.view(np.ndarray), orig_offs + 12
        parts: list[np.ndarray] = [item_type, count]
        if scalar is not None:
            size = np.dtype(scalar).itemsize
            if offs + n * size > len(data):
                raise ValueError(f"an array of {n} items runs past the end of the file")
            items = data[offs : offs + n * size].view(
                np.dtype(scalar).newbyteorder(self.byte_order)
            )
            parts += (items[i : i + 1] for i in range(n))
            offs += n * size
        else:
            for _ in range(n):
                length = data[offs : offs + 8].view(count.dtype)
                end = offs + 8 + int(length[0])
                parts += (length, data[offs + 8 : end])
                offs = end
        step = 1 if scalar is not None else 2
        types = [gguf.GGUFValueType.ARRAY, kind] if n else [gguf.GGUFValueType.ARRAY]
        return offs - orig_offs, parts, list(range(1 + step, len(parts), step)), types


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"the GGUF file lacks the metadata key {key!r}")
        return default
    return field.contents()


def gguf_arch(reader: gguf.GGUFReader) -> ModelArch:
    """The architecture described by the file's metadata (and tensor list)."""
    key = str(_field(reader, "general.architecture"))
    experts = int(_field(reader, f"{key}.expert_count", 0) or 0)
    name = "mixtral" if key == "llama" and experts else _GGUF_ARCHS.get(key, key)
    check_architecture(name)
    scaling = _field(reader, f"{key}.rope.scaling.type", "none")
    yarn_ok = scaling == "yarn" and key == "deepseek2"  # latent attention's YaRN (gguf_mla.py)
    if not yarn_ok and (
        scaling not in ("none", "linear")
        or float(_field(reader, f"{key}.rope.scaling.factor", 1.0)) != 1.0
    ):
        raise ModelLoadError(f"RoPE scaling {scaling!r} is not supported")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("the GGUF file has no token_embd.weight tensor")
    hidden = int(_field(reader, f"{key}.embedding_length"))
    num_heads = int(_field(reader, f"{key}.attention.head_count"))
    embd_shape = tensors["token_embd.weight"].shape  # GGUF order: [hidden, vocab]
    return ModelArch(
        architecture=name,
        num_layers=int(_field(reader, f"{key}.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{key}.feed_forward_length")),
        num_heads=num_heads,
        vocab_size=int(_field(reader, f"{key}.vocab_size", int(embd_shape[-1]))),
        rope_theta=float(_field(reader, f"{key}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{key}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_field(reader, f"{key}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        moe=moe_fields(functools.partial(_field, reader), key, name, tensors) if experts else None,
        **(_gemma3_fields(reader, hidden, num_heads) if name == "gemma3" else {}),
        **_heads(reader, key, hidden, num_heads),
    )


def _heads(reader: gguf.GGUFReader, key: str, hidden: int, num_heads: int) -> dict[str, Any]:
    """KV heads and head width (and latent attention's fields for `deepseek2`)."""
    if key == "deepseek2":
        return mla_fields(functools.partial(_field, reader), key, num_heads)
    return {
        "num_kv_heads": int(_field(reader, f"{key}.attention.head_count_kv", num_heads)),
        "head_dim": int(_field(reader, f"{key}.attention.key_length", hidden // max(num_heads, 1))),
    }


GEMMA3_GLOBAL_EVERY = 6
"""Gemma 3's layer pattern where the file is silent: five windowed layers, then a full one."""
GEMMA3_LOCAL_ROPE_BASE = 10000.0
"""Gemma 3's windowed layers' RoPE base where the file is silent (the full layers': freq_base)."""


def _gemma3_fields(reader: gguf.GGUFReader, hidden: int, num_heads: int) -> dict[str, Any]:
    """Gemma 3's windows, local RoPE base and query scale (llama.cpp's keys and defaults)."""
    layers = int(_field(reader, "gemma3.block_count"))
    window = int(_field(reader, "gemma3.attention.sliding_window"))
    pattern = reader.get_field("gemma3.attention.sliding_window_pattern")
    if pattern is not None and isinstance(pattern.contents(), list):  # per layer: windowed?
        windowed = [bool(v) for v in pattern.contents()]
    else:  # every n-th layer full
        every = int(pattern.contents()) if pattern is not None else GEMMA3_GLOBAL_EVERY
        windowed = [(i + 1) % every != 0 for i in range(layers)]
    if len(windowed) != layers:
        raise ModelLoadError(f"a sliding-window pattern of {len(windowed)} for {layers} layers")
    # 27B (62 layers) scales queries by its hidden size per head, the others by head_dim
    scale = (hidden / num_heads) ** -0.5 if layers == 62 else None
    return {
        "layer_windows": tuple(window if w else 0 for w in windowed),
        "rope_local_theta": float(
            _field(reader, "gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)
        ),
        "query_scale": scale,
    }


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows go back to rotate-half order per head."""
    half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


class GGUFTensorSource:
    """`TensorSource` over an open reader: dequantizes each tensor when asked."""

    def __init__(self, reader: gguf.GGUFReader, arch: ModelArch) -> None:
        self._tensors: dict[str, Any] = {}
        self._experts: dict[str, tuple[Any, int]] = {}
        """An expert's matrix -> (its layer's stacked tensor, its index there)."""
        for t in reader.tensors:
            parts = t.name.split(".", 2)
            if len(parts) == 3 and parts[0] == "blk" and parts[2] in EXPERT_STACKS:
                proj = EXPERT_STACKS[parts[2]]
                for j in range(int(t.shape[-1])):  # GGUF shapes run innermost first
                    self._experts[f"layers.{parts[1]}.mlp.experts.{j}.{proj}.weight"] = (t, j)
            else:
                self._tensors[canonical_name(t.name, arch.architecture)] = t
        self._arch = arch
        self._joined = {
            name.replace(".k_b_proj.", ".kv_b_proj.")
            for name in self._tensors
            if name.endswith("self_attn.k_b_proj.weight")
        } - set(self._tensors)
        """`kv_b_proj` of the layers whose file splits it (`gguf_mla.joined_kv_b`)."""

    def names(self) -> set[str]:
        parts = {
            n.replace(".kv_b_proj.", p) for n in self._joined for p in (".k_b_proj.", ".v_b_proj.")
        }
        return (set(self._tensors) - parts) | set(self._experts) | self._joined

    def _joined_kv_b(self, name: str) -> torch.Tensor:
        k_b = self.load(name.replace(".kv_b_proj.", ".k_b_proj.")).numpy()
        v_b = self.load(name.replace(".kv_b_proj.", ".v_b_proj.")).numpy()
        return torch.from_numpy(joined_kv_b(k_b, v_b, self._arch.num_heads).copy())

    def other_formats(self) -> dict[str, int]:
        """Matrices stored in formats the native kernel does not take, counted by format (they
        are dequantized to float32 at load)."""
        counts: dict[str, int] = {}
        for t in self._tensors.values():
            kind = t.tensor_type.name
            if len(t.shape) == 2 and kind not in (*_KERNEL_FORMATS, *_FLOAT_TYPES):
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def load_quantized(self, name: str, copy: bool = True) -> QuantizedWeight | None:
        """The tensor's blocks as stored (rows in the model's order), if it is a matrix in a
        format the native kernel takes (`_KERNEL_FORMATS`: Q4_0 and Q5_0 repacked); else None.
        With `copy` False, blocks stored as they are served are a read-only view of the file's
        mapping (for a repacking that reads them once: never write to it, never keep it)."""
        expert = self._experts.get(name)
        tensor = self._tensors.get(name) if expert is None else expert[0]
        kind = None if tensor is None else tensor.tensor_type.name
        if tensor is None or kind not in _KERNEL_FORMATS:
            return None
        fmt = _KERNEL_FORMATS[kind]
        if expert is not None:  # its slice of the layer's stack
            array = np.asarray(tensor.data)[expert[1]]
        else:
            array = self._unpermuted(name, np.asarray(tensor.data))
        if array.ndim != 2:
            return None
        if kind in _REPACKED:
            repacked = _REPACKED[kind](array)
            if repacked is None:
                return None
            array = repacked
        if copy or array.dtype != np.uint8 or not array.flags.c_contiguous:
            array = np.array(array, dtype=np.uint8, copy=True)
        with warnings.catch_warnings():  # torch warns of a read-only array: it is only read
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(array)
        return QuantizedWeight(fmt, blocks, array.shape[1] // fmt.block_bytes * fmt.block_weights)

    def load(self, name: str) -> torch.Tensor:
        blocks = self.load_quantized(name)
        if blocks is not None:  # the same values as gguf-py's, a tenth of the time
            return dequantize(blocks)
        if name in self._experts:
            return self._load_expert(name)
        if name in self._joined:
            return self._joined_kv_b(name)
        tensor = self._tensors[name]
        array = self._dequantized(tensor, tensor.data)
        if name.endswith("shared_expert_gate.weight"):
            array = array.reshape(1, -1)  # stored as a vector
        array = self._unpermuted(name, array)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, copy=True)
        return torch.from_numpy(array)

    def _load_expert(self, name: str) -> torch.Tensor:
        """One expert's matrix: its slice of the layer's stack, dequantized alone."""
        tensor, j = self._experts[name]
        array = self._dequantized(tensor, np.asarray(tensor.data)[j])
        return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))

    @staticmethod
    def _dequantized(tensor: Any, data: np.ndarray) -> np.ndarray:
        try:
            array = gguf.quants.dequantize(data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(
                f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}"
            ) from exc
        return np.asarray(array, dtype=np.float32)

    def _unpermuted(self, name: str, array: np.ndarray) -> np.ndarray:
        """Llama's Q and K rows back in rotate-half order (rows of weights or of blocks)."""
        if self._arch.architecture in _PERMUTED_QK:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                return unpermute_qk(array, self._arch.num_heads)
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                return unpermute_qk(array, self._arch.num_kv_heads)
        return array
