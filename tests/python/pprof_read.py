"""Reads a gzipped pprof profile with the protobuf package and pprof's own
profile.proto (compiled by grpc_tools.protoc into STUBS), and prints it as
JSON: the sample type and each sample's function names, leaf first, with
its values.

usage: pprof_read.py STUBS PROFILE
"""
import gzip
import json
import sys

sys.path.insert(0, sys.argv[1])
import profile_pb2  # noqa: E402

with open(sys.argv[2], "rb") as f:
    p = profile_pb2.Profile.FromString(gzip.decompress(f.read()))
s = p.string_table
functions = {fn.id: fn for fn in p.function}
locations = {loc.id: loc for loc in p.location}


def name(location_id):
    loc = locations[location_id]
    fn = functions[loc.line[0].function_id]
    return s[fn.name]


print(json.dumps({
    "sample_type": [[s[t.type], s[t.unit]] for t in p.sample_type],
    "samples": [
        {"frames": [name(i) for i in sample.location_id], "value": list(sample.value)}
        for sample in p.sample
    ],
    "modules": sorted({s[m.filename] for m in p.mapping}),
}))
