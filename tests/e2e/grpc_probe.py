"""One unary gRPC call, as a process of its own (run it inside a test host's namespace):
prints `ok` or the call's status code name. The request is an empty message and the
answer is not decoded, so no stubs are needed.

    python3 grpc_probe.py ADDR /pkg.Service/Method [--ca CA [--cert CERT --key KEY]]

Without --ca the channel is plaintext; with --ca alone it is TLS without a client
certificate."""

import argparse
import sys

import grpc

p = argparse.ArgumentParser()
p.add_argument("addr")
p.add_argument("method")
p.add_argument("--ca")
p.add_argument("--cert")
p.add_argument("--key")
a = p.parse_args()
read = lambda path: open(path, "rb").read() if path else None
if a.ca:
    creds = grpc.ssl_channel_credentials(read(a.ca), read(a.key), read(a.cert))
    channel = grpc.secure_channel(a.addr, creds)
else:
    channel = grpc.insecure_channel(a.addr)
call = channel.unary_unary(a.method, request_serializer=None, response_deserializer=None)
try:
    call(b"", timeout=5)
    print("ok")
except grpc.RpcError as e:
    print(e.code().name, e.details(), file=sys.stderr)
    print(e.code().name)
