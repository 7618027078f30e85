"""Regenerate the committed Python modules of the gRPC contracts: `python -m proto.generate`.

The generated modules are committed because the GPU machine has no grpcio-tools. One function,
`generate`, is the only generation path: the command writes into the repository, the staleness
test into a temporary directory, and both compare equal only when the committed code is current.

NOTE (compatibility): grpcio-tools stamps each `*_pb2_grpc.py` with `GRPC_GENERATED_VERSION`, its
own version, and the module refuses to import under an older grpcio. The stubs only use API that
exists since grpcio 1.64 (`_registered_method=True` on channels since 1.63,
`Server.add_registered_method_handlers` since 1.64), so the stamp is lowered to that floor and the
same code imports under grpcio 1.84 on the GPU machine. The `*_pb2.py` runtime guard is left alone:
it only asks for a protobuf runtime of the same major version, not older than the gencode's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "proto"
GRPC_FLOOR = "1.64.0"
_GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '[0-9.]+'$", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generated_names() -> list[str]:
    """Paths (relative to the output root) that `generate` writes."""
    names = []
    for proto in proto_files():
        stem = f"proto/{proto.stem}"
        names += [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]
    return names


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every proto/*.proto into `out_root/proto/` and lower the grpcio stamp.

    Returns the written files."""
    from importlib.resources import files

    from grpc_tools import protoc

    well_known = str(files("grpc_tools") / "_proto")
    args = ["protoc", f"-I{REPO_ROOT}", f"-I{well_known}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}"]
    if protoc.main(args + [str(p) for p in proto_files()]) != 0:
        raise RuntimeError("protoc failed on proto/*.proto (its errors are above)")
    written = [out_root / name for name in generated_names()]
    for path in written:
        if path.name.endswith("_pb2_grpc.py"):
            _lower_grpc_stamp(path)
    return written


def _lower_grpc_stamp(path: Path) -> None:
    text, count = _GRPC_STAMP.subn(f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'", path.read_text())
    if count != 1:
        raise RuntimeError(f"{path}: expected one GRPC_GENERATED_VERSION line, found {count}; "
                           "grpcio-tools changed its output, revisit proto/generate.py")
    path.write_text(text)


def main() -> int:
    for path in generate(REPO_ROOT):
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
