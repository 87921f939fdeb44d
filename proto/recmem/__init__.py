"""recmem protobuf packages."""
