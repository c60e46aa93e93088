"""A CXL-RPC server or client in its own process, driven by the multi-process CXL-RPC tests.

serve  --name N [--queue-depth Q] [--payload-bytes B]
       prints {"pid": ...} when serving, {"dead": client_id} whenever on_client_dead runs and
       {"slow": client_id} when a SLOW request starts; serves until its stdin closes. Ops:
         ECHO  (1) -> u32 client_id, then the payload reversed
         RAISE (2) -> the handler raises ValueError("boom")
         SLOW  (3) -> sleeps float(payload) seconds in the handler (blocking the poll thread), then b"done"
hammer --name N --seed S --calls K --concurrency C [--wait-for-go]
       (with --wait-for-go: attaches, prints {"attached": client_id}, waits for a line on stdin), then
       C asyncio tasks make K ECHO calls each with random payloads (0..slot bytes - 4) and check each byte
       of every reply; prints {"client_id": ..., "calls": ..., "bad": [first mismatches]}.
hold   --name N
       attaches, prints {"client_id": ...}, then makes ECHO calls until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import struct
import sys
import time

from shared.cxl.rpc import RpcClient, RpcConfig, RpcServer

ECHO, RAISE, SLOW = 1, 2, 3
_ID = struct.Struct("<I")


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def handler(client_id: int, op: int, payload: memoryview) -> tuple[int, bytes]:
    if op == ECHO:
        return 0, _ID.pack(client_id) + bytes(payload)[::-1]
    if op == RAISE:
        raise ValueError("boom")
    if op == SLOW:
        say(slow=client_id)
        time.sleep(float(bytes(payload).decode()))
        return 0, b"done"
    return 100, b"unknown op"


def serve(args: argparse.Namespace) -> None:
    config = RpcConfig(queue_depth=args.queue_depth, payload_bytes=args.payload_bytes)
    server = RpcServer(args.name, handler, config=config, on_client_dead=lambda c: say(dead=c))
    server.start()
    say(pid=os.getpid())
    try:
        sys.stdin.read()
    finally:
        server.close()


async def hammer(args: argparse.Namespace) -> None:
    client = RpcClient(args.name)
    rng = random.Random(args.seed)
    bad: list[str] = []
    if args.wait_for_go:
        say(attached=client.client_id)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    async def worker(task: int) -> None:
        for i in range(args.calls):
            size = rng.randrange(client.payload_bytes - _ID.size + 1)  # the reply adds the id
            payload = rng.randbytes(size)
            status, reply = await client.acall(ECHO, payload, 10.0)
            expected = _ID.pack(client.client_id) + payload[::-1]
            if status != 0 or reply != expected:
                bad.append(f"task {task} call {i}: status {status}, {len(reply)} bytes vs {len(expected)}")

    await asyncio.gather(*(worker(t) for t in range(args.concurrency)))
    say(client_id=client.client_id, calls=args.calls * args.concurrency, bad=bad[:5])
    client.close()


def hold(args: argparse.Namespace) -> None:
    client = RpcClient(args.name)
    say(client_id=client.client_id)
    while True:
        client.call(ECHO, b"still here", 10.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("serve", "hammer", "hold"))
    parser.add_argument("--name", required=True)
    parser.add_argument("--queue-depth", type=int, default=4)
    parser.add_argument("--payload-bytes", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--wait-for-go", action="store_true", help="hammer: attach, then await a stdin line")
    args = parser.parse_args()
    if args.role == "serve":
        serve(args)
    elif args.role == "hammer":
        asyncio.run(hammer(args))
    else:
        hold(args)


if __name__ == "__main__":
    main()
