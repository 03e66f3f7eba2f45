"""A small gRPC client for moray.v1 (`python -m cluster.grpc_client --address HOST:PORT --prompt TEXT`).

Streams the generation to stdout; shows how to call the service from the generated stubs.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from protos.moray.v1 import moray_pb2, moray_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.grpc_client")
    p.add_argument("--address", default="127.0.0.1:9000")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--application", default=None, help="Serve application name, when several are deployed")
    p.add_argument("--api-key", default=os.environ.get("MORAY_API_KEY"))
    args = p.parse_args(argv)
    metadata = []
    if args.api_key:
        metadata.append(("authorization", f"Bearer {args.api_key}"))
    if args.application:
        metadata.append(("application", args.application))
    request = moray_pb2.GenerateRequest(
        prompt=args.prompt, sampling=moray_pb2.SamplingOptions(max_tokens=args.max_tokens, temperature=args.temperature)
    )
    with grpc.insecure_channel(args.address) as channel:
        stub = moray_pb2_grpc.MorayStub(channel)
        try:
            for part in stub.Generate(request, metadata=metadata, timeout=300):
                sys.stdout.write(part.text)
                sys.stdout.flush()
                if part.finished:
                    u = part.usage
                    print(f"\n[{part.finish_reason}; prompt {u.prompt_tokens}, completion {u.completion_tokens}, cached {u.cached_tokens}]")
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
