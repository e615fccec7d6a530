"""Build step: generate the gRPC stubs of lockd.v1 from the repository's proto at build time.

The proto is looked up in $LOCKD_PROTO_DIR, then ../../lockd/api/proto (a checkout: `pip install
./clients/python`), then ./proto (an sdist, which carries a copy). The generated modules land in
lockd_client/_pb in the build directory (in the source tree for editable installs).
"""

import os
import re
import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PROTO_REL = Path("lockd/v1/lockd.proto")


def proto_root() -> Path:
    candidates = []
    if os.environ.get("LOCKD_PROTO_DIR"):
        candidates.append(Path(os.environ["LOCKD_PROTO_DIR"]))
    candidates += [HERE.parent.parent / "lockd" / "api" / "proto", HERE / "proto"]
    for root in candidates:
        if (root / PROTO_REL).is_file():
            return root
    raise SystemExit(
        "lockd-client: cannot find %s under any of %s; set LOCKD_PROTO_DIR"
        % (PROTO_REL, ", ".join(str(c) for c in candidates))
    )


def generate(out_pkg: Path) -> None:
    from grpc_tools import protoc  # build requirement (pyproject.toml)
    import grpc_tools

    root = proto_root()
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_pkg.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            "-I%s" % root,
            "-I%s" % well_known,
            "--python_out=%s" % tmp,
            "--pyi_out=%s" % tmp,
            "--grpc_python_out=%s" % tmp,
            str(root / PROTO_REL),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("lockd-client: protoc failed on %s" % (root / PROTO_REL))
        gen = Path(tmp) / PROTO_REL.parent
        for name in ("lockd_pb2.py", "lockd_pb2.pyi", "lockd_pb2_grpc.py"):
            text = (gen / name).read_text()
            # protoc writes absolute imports of the proto package (`from lockd.v1 import ...`);
            # the stubs live inside lockd_client._pb, so make them relative.
            text = re.sub(r"^from lockd\.v1 import ", "from . import ", text, flags=re.M)
            (out_pkg / name).write_text(text)
    init = out_pkg / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC stubs of lockd.v1 (built from lockd/api/proto)."""\n')


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            generate(HERE / "lockd_client" / "_pb")
        else:
            generate(Path(self.build_lib) / "lockd_client" / "_pb")


class SdistWithProto(sdist):
    def make_release_tree(self, base_dir, files) -> None:
        super().make_release_tree(base_dir, files)
        dest = Path(base_dir) / "proto" / PROTO_REL
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(proto_root() / PROTO_REL, dest)


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProto})
