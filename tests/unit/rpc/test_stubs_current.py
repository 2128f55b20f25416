"""The checked-in stubs in pdserve/rpc/gen were generated from today's proto files (`make proto`)."""
import importlib
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from google.protobuf import descriptor_pb2

PROTO_ROOT = Path(__file__).resolve().parents[3] / "proto"


def clear_json_names(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        clear_json_names(message.nested_type)


def without_json_names(file: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """protoc's descriptor sets name each field's JSON spelling; generated modules leave it out."""
    clear_json_names(file.message_type)
    return file


def test_checked_in_stubs_match_the_proto_files(tmp_path: Path) -> None:
    descriptor_set = tmp_path / "descriptors.pb"
    protos = sorted((PROTO_ROOT / "pdserve" / "v1").glob("*.proto"))
    args = [f"-I{PROTO_ROOT}", f"--descriptor_set_out={descriptor_set}", *map(str, protos)]
    # protoc runs in its own process: grpc_tools' compiler module can crash a process that
    # already loaded torch and protobuf's upb runtime.
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args], check=True, timeout=120)
    compiled = {f.name: without_json_names(f)
                for f in descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file}
    modules = [importlib.import_module(f"pdserve.rpc.gen.{proto.stem}_pb2") for proto in protos]
    checked_in = {d.name: d for d in (descriptor_pb2.FileDescriptorProto.FromString(m.DESCRIPTOR.serialized_pb)
                                      for m in modules)}
    assert checked_in == compiled
