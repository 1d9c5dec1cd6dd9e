"""One unary gRPC call, as a process of its own (run it inside a test host's namespace):
prints `ok` or the call's status code name. The request is an empty message unless
--request-hex gives its encoded bytes, and the answer is not decoded (--show prints its
bytes in hex on a second line), so no stubs are needed.

    python3 grpc_probe.py ADDR /pkg.Service/Method [--ca CA [--cert CERT --key KEY]]
        [--server-name NAME] [--request-hex HEX] [--show] [--no-token]

Without --ca the channel is plaintext; with --ca alone it is TLS without a client
certificate. --server-name checks the server's certificate for NAME instead of ADDR. The
call carries the mesh token from $PDMESH_MESH_TOKEN (as `authorization: Bearer`) unless
--no-token is given or the variable is unset."""

import argparse
import os
import sys

import grpc

p = argparse.ArgumentParser()
p.add_argument("addr")
p.add_argument("method")
p.add_argument("--ca")
p.add_argument("--cert")
p.add_argument("--key")
p.add_argument("--server-name")
p.add_argument("--request-hex", default="")
p.add_argument("--show", action="store_true")
p.add_argument("--no-token", action="store_true")
a = p.parse_args()
token = None if a.no_token else os.environ.get("PDMESH_MESH_TOKEN")
metadata = [("authorization", f"Bearer {token}")] if token else None
read = lambda path: open(path, "rb").read() if path else None
if a.ca:
    creds = grpc.ssl_channel_credentials(read(a.ca), read(a.key), read(a.cert))
    options = [("grpc.ssl_target_name_override", a.server_name)] if a.server_name else []
    channel = grpc.secure_channel(a.addr, creds, options=options)
else:
    channel = grpc.insecure_channel(a.addr)
call = channel.unary_unary(a.method, request_serializer=None, response_deserializer=None)
try:
    answer = call(bytes.fromhex(a.request_hex), timeout=5, metadata=metadata)
    print("ok")
    if a.show:
        print(answer.hex())
except grpc.RpcError as e:
    print(e.code().name, e.details(), file=sys.stderr)
    print(e.code().name)
