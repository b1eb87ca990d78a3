"""Regenerate swarmlm_pb2.py from swarmlm.proto (a developer tool; needs grpcio-tools)."""

from pathlib import Path

from grpc_tools import protoc


def main() -> None:
    here = Path(__file__).parent
    code = protoc.main(
        ["protoc", f"-I{here}", f"--python_out={here}", f"--pyi_out={here}", str(here / "swarmlm.proto")]
    )
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


if __name__ == "__main__":
    main()
