#!/usr/bin/env python3
"""An independent reader of TensorBoard event files, for tests/spawn/summary_writer_test.cc.

Reads every TFRecord of the file (uint64 length, masked CRC32C of it, the data,
masked CRC32C of the data), checks both CRCs with a bit-by-bit CRC32C of its own
(not tandem's table), and decodes each record with protobuf's Python runtime
(Debian python3-protobuf) as tensorflow.Event, whose descriptor is built here
from TensorFlow's event.proto / summary.proto field numbers. Prints one line per
event:
    version <wall_time> <file_version>
    scalar <step> <tag> <simple_value> <wall_time>
    session_log <step> status <status>           (1: START)
and exits 1 with a message on the first malformed record.

    python3 tests/spawn/observe/read_tfevents.py DIR/events.out.tfevents....
"""
import struct
import sys

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def event_class():
    f = descriptor_pb2.FileDescriptorProto(name="tfevents_subset.proto", package="tensorflow",
                                           syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto
    value = f.message_type.add(name="Value")
    value.field.add(name="tag", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=T.TYPE_FLOAT, label=T.LABEL_OPTIONAL)
    summary = f.message_type.add(name="Summary")
    summary.field.add(name="value", number=1, type=T.TYPE_MESSAGE, label=T.LABEL_REPEATED,
                      type_name=".tensorflow.Value")
    event = f.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=T.TYPE_DOUBLE, label=T.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=T.TYPE_INT64, label=T.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    event.field.add(name="summary", number=5, type=T.TYPE_MESSAGE, label=T.LABEL_OPTIONAL,
                    type_name=".tensorflow.Summary")
    session = f.message_type.add(name="SessionLog")
    session.field.add(name="status", number=1, type=T.TYPE_INT32, label=T.LABEL_OPTIONAL)
    event.field.add(name="session_log", number=7, type=T.TYPE_MESSAGE, label=T.LABEL_OPTIONAL,
                    type_name=".tensorflow.SessionLog")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    descriptor = pool.FindMessageTypeByName("tensorflow.Event")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)


def main(path):
    Event = event_class()
    data = open(path, "rb").read()
    offset = 0
    index = 0
    while offset < len(data):
        if len(data) - offset < 12:
            sys.exit(f"{path}: record {index}: {len(data) - offset} trailing bytes")
        header = data[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[offset + 8:offset + 12])
        if header_crc != masked(header):
            sys.exit(f"{path}: record {index}: length CRC {header_crc:#x} != {masked(header):#x}")
        body = data[offset + 12:offset + 12 + length]
        if len(body) != length or offset + 16 + length > len(data):
            sys.exit(f"{path}: record {index}: truncated")
        (body_crc,) = struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])
        if body_crc != masked(body):
            sys.exit(f"{path}: record {index}: data CRC {body_crc:#x} != {masked(body):#x}")
        event = Event()
        event.ParseFromString(body)
        if event.file_version:
            print(f"version {event.wall_time:.3f} {event.file_version}")
        if event.HasField("session_log"):
            print(f"session_log {event.step} status {event.session_log.status}")
        for v in event.summary.value:
            print(f"scalar {event.step} {v.tag} {v.simple_value!r} {event.wall_time:.3f}")
        offset += 16 + length
        index += 1


if __name__ == "__main__":
    main(sys.argv[1])
