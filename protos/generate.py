"""Generate the Python gRPC stubs for protos/*.proto into embeddings/triton/protocol/.

Run as `python protos/generate.py` (the Makefile does it at setup). protoc writes bare
sibling imports (`import model_config_pb2 as ...`) that only work with the output directory
on sys.path; they are rewritten into package-relative imports. Does nothing when every
output is newer than every proto and than this script; `--force` regenerates anyway.
"""

import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
OUTPUT_DIR = PROTO_DIR.parent / "embeddings" / "triton" / "protocol"

# `import x_pb2 as y` (in .py) and `import x_pb2 as _x_pb2` (in .pyi) at the start of a line.
BARE_IMPORT = re.compile(r"^import (\w+_pb2(?:_grpc)?) as (\w+)$", re.MULTILINE)


def expected_outputs(protos: list[Path]) -> list[Path]:
    outputs = []
    for proto in protos:
        # protoc writes a *_pb2_grpc.py for every proto, an empty one when it has no service.
        outputs += [
            OUTPUT_DIR / f"{proto.stem}{suffix}" for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
        ]
    return outputs


def up_to_date(protos: list[Path], outputs: list[Path]) -> bool:
    if not all(output.exists() for output in outputs):
        return False
    newest_source = max(path.stat().st_mtime for path in [*protos, Path(__file__)])
    return min(output.stat().st_mtime for output in outputs) > newest_source


def make_imports_relative(path: Path, local_modules: set[str]) -> None:
    def replace(match: re.Match) -> str:
        module, alias = match.groups()
        if module not in local_modules:
            return match.group(0)
        return f"from . import {module} as {alias}"

    text = path.read_text()
    rewritten = BARE_IMPORT.sub(replace, text)
    if rewritten != text:
        path.write_text(rewritten)


def generate(force: bool = False) -> bool:
    """Generate the stubs; return False when they were already up to date."""
    from grpc_tools import protoc  # deferred: only setup needs grpcio-tools

    protos = sorted(PROTO_DIR.glob("*.proto"))
    outputs = expected_outputs(protos)
    if not force and up_to_date(protos, outputs):
        return False

    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    well_known_protos = Path(protoc.__file__).resolve().parent / "_proto"
    arguments = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_DIR}",
        f"--proto_path={well_known_protos}",
        f"--python_out={OUTPUT_DIR}",
        f"--pyi_out={OUTPUT_DIR}",
        f"--grpc_python_out={OUTPUT_DIR}",
        *(str(proto) for proto in protos),
    ]
    if protoc.main(arguments) != 0:
        raise SystemExit(f"protoc failed on {', '.join(p.name for p in protos)}")

    local_modules = {output.stem for output in outputs}
    for output in outputs:
        make_imports_relative(output, local_modules)
    return True


if __name__ == "__main__":
    changed = generate(force="--force" in sys.argv[1:])
    print(f"protocol stubs {'generated' if changed else 'up to date'} in {OUTPUT_DIR}")
