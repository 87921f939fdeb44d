"""Generated protobuf code for the recmem.v1 wire format (see scripts/gen_proto.sh)."""
