"""Generated protobuf code (scripts/gen_proto.sh). Import it only from demonet.wire."""
