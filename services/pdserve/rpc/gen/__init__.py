"""Generated protobuf and gRPC modules. Do not edit: change `proto/` and run `make proto`."""
