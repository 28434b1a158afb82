"""Write a GGUF's first N layers (with its embeddings, final norm, LM head and vocabulary) as a
GGUF of their own: a draft model for `--speculative draft-model` where no smaller model with the
same vocabulary exists (SmolLM2's smallest is the default model). Tensors are copied in their
own quantized blocks, so the draft runs on the same native kernels.

    python bench/truncated_draft.py MODEL.gguf OUT.gguf --layers 8
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf


def truncate(src: Path, dst: Path, num_layers: int) -> None:
    reader = gguf.GGUFReader(src)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == f"{arch}.block_count":
            writer.add_uint32(name, num_layers)
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= num_layers:
            continue
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    truncate(args.model, args.out, args.layers)


if __name__ == "__main__":
    main()
