"""A fleet dump through bpfmap-relay from Python (grpcio, stubs generated
from the proto by grpc_tools.protoc): the first CUT messages, then the rest
resumed from the cursor of the last one read, and a cursor that is not the
relay's. Prints one JSON object: every target's entries (hex key and value)
in the order received, every target's end, and the code of the bad cursor.

Usage: fleet_dump.py STUBS_DIR RELAY_ADDR MAP CUT
"""
import json
import sys

sys.path.insert(0, sys.argv[1])

import grpc  # noqa: E402
from bpfmap.v1 import fleet_service_pb2, fleet_service_pb2_grpc, map_service_pb2  # noqa: E402


def request(path, cursor=""):
    return fleet_service_pb2.FleetServiceDumpMapRequest(
        request=map_service_pb2.DumpMapRequest(
            map=map_service_pb2.MapRef(path=path), chunk_size=64, raw=True
        ),
        cursor=cursor,
    )


def read(stub, req, out, most=None):
    """Reads at most `most` messages into `out`; the last cursor."""
    stream = stub.DumpMap(req, timeout=60)
    cursor, n = "", 0
    for msg in stream:
        part = msg.WhichOneof("part")
        if part == "chunk":
            out["entries"].setdefault(msg.target, []).extend(
                [e.key.hex(), e.value.hex()] for e in msg.chunk.entries
            )
        else:
            out["ends"][msg.target] = {
                "code": msg.end.status.code,
                "entries": msg.end.entries,
                "complete": msg.end.complete,
            }
        cursor, n = msg.cursor, n + 1
        if most is not None and n == most:
            stream.cancel()
            break
    return cursor


def main():
    _, _, addr, path, cut = sys.argv
    with grpc.insecure_channel(addr) as channel:
        stub = fleet_service_pb2_grpc.FleetServiceStub(channel)
        out = {"entries": {}, "ends": {}, "first_ends": {}}
        cursor = read(stub, request(path), out, most=int(cut))
        out["first_ends"] = dict(out["ends"])
        read(stub, request(path, cursor), out)
        try:
            read(stub, request(path, "fnot-a-cursor"), {"entries": {}, "ends": {}})
            out["bad_cursor"] = "OK"
        except grpc.RpcError as e:
            out["bad_cursor"] = e.code().name
            out["bad_cursor_message"] = e.details()
    json.dump(out, sys.stdout)


main()
