"""The Arrow cases of the performance check: a Python process reading one
map over and over as told on stdin, timing each read itself (the
interpreter's start and its imports are not part of it), and answering
"SECONDS ROWS" on stdout.

    arrow_read.py URL MAP STUBS_DIR

stdin, one word a line:
    flight   pyarrow.flight: get_flight_info, then do_get(...).read_all()
    pandas   the same, then .to_pandas()
    grpc     grpcio DumpMap (stubs in STUBS_DIR), each entry's typed JSON
             (decodedKey, decodedValue) into a pandas DataFrame
"""
import json
import sys
import time

sys.path.insert(0, sys.argv[3])

import pandas as pd  # noqa: E402
import pyarrow.flight as flight  # noqa: E402


def flight_table(url, path):
    c = flight.connect(url.replace("http://", "grpc://"))
    command = json.dumps({"dump": {"map": {"path": path}}}).encode()
    info = c.get_flight_info(flight.FlightDescriptor.for_command(command))
    return c.do_get(info.endpoints[0].ticket).read_all()


def grpc_frame(url, path):
    import grpc
    from google.protobuf import json_format
    from bpfmap.v1 import map_service_pb2, map_service_pb2_grpc

    with grpc.insecure_channel(
        url.replace("http://", ""),
        options=[("grpc.max_receive_message_length", 64 << 20)],
    ) as channel:
        stub = map_service_pb2_grpc.MapServiceStub(channel)
        req = map_service_pb2.DumpMapRequest(map=map_service_pb2.MapRef(path=path))
        rows = []
        for msg in stub.DumpMap(req, timeout=600):
            for e in msg.entries:
                rows.append(
                    {
                        "key": json_format.MessageToDict(e.decoded_key),
                        "value": json_format.MessageToDict(e.decoded_value),
                    }
                )
        return pd.json_normalize(rows)


def main():
    url, path = sys.argv[1], sys.argv[2]
    for line in sys.stdin:
        what = line.strip()
        t = time.perf_counter()
        if what == "flight":
            rows = flight_table(url, path).num_rows
        elif what == "pandas":
            rows = len(flight_table(url, path).to_pandas())
        elif what == "grpc":
            rows = len(grpc_frame(url, path))
        else:
            raise SystemExit(f"unknown read {what}")
        print(f"{time.perf_counter() - t} {rows}", flush=True)


if __name__ == "__main__":
    main()
