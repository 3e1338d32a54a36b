"""Maps as Arrow tables, read as a Python user reads them (pyarrow.flight,
pyarrow.ipc, polars, DuckDB). Prints one JSON document on stdout.

    arrow_tables.py table  URL COMMAND [TLS...]   the table of a command
    arrow_tables.py list   URL [TLS...]           ListFlights
    arrow_tables.py resume URL COMMAND BATCHES    cut after BATCHES batches, resumed
                                                  (a relay's: with the fleet cursor)
    arrow_tables.py sql    URL COMMAND SQL        DuckDB over the table (named t)
    arrow_tables.py ipc    FILE                   an IPC stream file, through polars

TLS is CA CERT KEY (files): mutual TLS as the daemon's callers present it.
Values print as JSON: decimals and bytes as strings.
"""

import base64
import json
import sys

import pyarrow as pa
import pyarrow.flight as flight


def client(url, tls):
    if not tls:
        return flight.connect(url)
    ca, cert, key = (open(f, "rb").read() for f in tls)
    return flight.connect(url, tls_root_certs=ca, cert_chain=cert, private_key=key)


def value(v):
    if isinstance(v, bytes):
        return base64.b16encode(v).decode().lower()
    return str(v)


def rows(table):
    return json.loads(json.dumps(table.to_pylist(), default=value))


def schema(s):
    return [[f.name, str(f.type)] for f in s]


def failure(e):
    # pyarrow names the gRPC status by its exception's class.
    return {"error": type(e).__name__, "message": str(e).split(". Detail")[0]}


def table(url, command, tls):
    c = client(url, tls)
    try:
        info = c.get_flight_info(flight.FlightDescriptor.for_command(command))
        reader = c.do_get(info.endpoints[0].ticket)
        batches, metadata = [], []
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            if chunk.data is not None and chunk.data.num_rows:
                batches.append(chunk.data)
            if chunk.app_metadata is not None:
                metadata.append(json.loads(chunk.app_metadata.to_pybytes()))
    except (flight.FlightError, pa.ArrowException) as e:
        return failure(e)
    t = pa.Table.from_batches(batches, schema=reader.schema)
    return {
        "schema": schema(info.schema),
        "read_schema": schema(t.schema),
        "total_records": info.total_records,
        "rows": rows(t),
        "metadata": metadata,
    }


def listing(url, tls):
    try:
        flights = list(client(url, tls).list_flights())
    except (flight.FlightError, pa.ArrowException) as e:
        return failure(e)
    return [
        {
            "command": base64.b64encode(f.descriptor.command).decode(),
            "columns": f.schema.names,
            "total_records": f.total_records,
        }
        for f in flights
    ]


def resume(url, command, cut):
    """Reads CUT batches, then resumes from the cursor of the last message
    read: a daemon's dump cursor, or (a command with "targets") the
    relay's fleet cursor, which its ends carry too. The rest is read with
    read_all(), as most programs read a table."""
    c = client(url, None)
    reader = c.do_get(flight.Ticket(command))
    kept, cursor = [], None
    while len(kept) < cut:
        chunk = reader.read_chunk()
        if chunk.data is not None and chunk.data.num_rows:
            kept.append(chunk.data)
        if chunk.app_metadata is not None:
            cursor = json.loads(chunk.app_metadata.to_pybytes())["cursor"]
    reader.cancel()
    again = json.loads(command)
    if "targets" in again:
        again["fleet_cursor"] = cursor
    else:
        again["dump"]["cursor"] = cursor
    rest = c.do_get(flight.Ticket(json.dumps(again).encode())).read_all()
    first = pa.Table.from_batches(kept)
    return {"before": rows(first), "after": rows(rest)}


def sql(url, command, query):
    import duckdb

    t = client(url, None).do_get(flight.Ticket(command)).read_all()
    return json.loads(json.dumps(duckdb.sql(query).fetchall(), default=value))


def ipc(path):
    import polars as pl

    frame = pl.read_ipc_stream(path)
    return {
        "shape": list(frame.shape),
        "columns": frame.columns,
        "rows": json.loads(frame.write_json()),
    }


def main(argv):
    mode = argv[1]
    if mode == "table":
        out = table(argv[2], argv[3].encode(), argv[4:7])
    elif mode == "list":
        out = listing(argv[2], argv[3:6])
    elif mode == "resume":
        out = resume(argv[2], argv[3].encode(), int(argv[4]))
    elif mode == "sql":
        out = sql(argv[2], argv[3].encode(), argv[4])
    elif mode == "ipc":
        out = ipc(argv[2])
    else:
        raise SystemExit(f"unknown mode {mode}")
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv)
