"""Requests for the gRPC fuzz (test_grpc_fuzz.py), built from the services' descriptors: random
and boundary field values, raw bytes mutated, and oversized repeated fields (many entries or
one huge entry, at any depth) in otherwise valid requests."""

from __future__ import annotations

import random
from typing import Any

from google.protobuf import descriptor, message

from switchboard.api.v1 import generation_service_pb2, model_service_pb2
from switchboard.api.v1 import generation_service_pb2 as pb

F = descriptor.FieldDescriptor
OVERSIZED_PER_FIELD = 2  # per repeated field: of each kind (many entries, one huge entry)
MANY_ENTRIES = (10**4, 3 * 10**4, 10**5)
HUGE_ENTRY_CHARS = 1 << 20

_INTS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}  # fmt: skip
_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-45, 1e30, -1e30, float("inf"), float("-inf"),
           float("nan"), 3.4e38, 100.0]  # fmt: skip
_STRINGS = ["", "tiny", "Hello", " ", "\x00", "a" * 300, "é€😀", "\n\t", "<|endoftext|>", "{",
            "null", "-1", "x" * 5000, "tiny\x00", "../../etc/passwd", "%s%n"]  # fmt: skip


def _scalar(field: descriptor.FieldDescriptor, rng: random.Random) -> Any:
    kind = field.type
    if kind in _INTS:
        low, high = _INTS[kind]
        return rng.choice([0, 1, -1 if low < 0 else 2, low, high, rng.randint(0, 300),
                           rng.randint(low, high), 16, 64, 65, 299, 300])  # fmt: skip
    if kind in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        value = rng.choice([*_FLOATS, rng.uniform(-10, 10)])
        return value if kind == F.TYPE_DOUBLE or abs(value) <= 3.4e38 else float("inf")
    if kind == F.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == F.TYPE_STRING:
        if rng.random() < 0.2:
            return "".join(chr(rng.randint(1, 0xD7FF)) for _ in range(rng.randint(1, 40)))
        return rng.choice(_STRINGS)
    if kind == F.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 7, 64]))
    if kind == F.TYPE_ENUM:
        values = [v.number for v in field.enum_type.values]
        return rng.choice([*values, *values, -1, 99, 2**31 - 1])
    raise AssertionError(field.type)


def fill(msg: message.Message, rng: random.Random, depth: int = 0) -> message.Message:
    """Set a random subset of ``msg``'s fields, nested messages to depth 4."""
    for field in msg.DESCRIPTOR.fields:
        if rng.random() < 0.45:
            continue
        is_message = field.type == F.TYPE_MESSAGE
        if is_message and depth >= 4:
            continue
        if field.is_repeated:
            count = rng.choice([0, 1, 2, 3, 8, 64, 600]) if depth < 2 else rng.choice([0, 1, 2])
            container = getattr(msg, field.name)
            if is_message and field.message_type.GetOptions().map_entry:
                key_field, value_field = field.message_type.fields
                for _ in range(min(count, 40)):
                    key = _scalar(key_field, rng)
                    if value_field.type == F.TYPE_MESSAGE:
                        fill(container[key], rng, depth + 1)
                    else:
                        container[key] = _scalar(value_field, rng)
            elif is_message:
                for _ in range(min(count, 16)):
                    fill(container.add(), rng, depth + 1)
            else:
                container.extend(_scalar(field, rng) for _ in range(count))
        elif is_message:
            sub = getattr(msg, field.name)
            sub.SetInParent()
            fill(sub, rng, depth + 1)
        else:
            setattr(msg, field.name, _scalar(field, rng))
    return msg


def valid_generate(rng: random.Random) -> pb.GenerateRequest:
    """A mostly well-formed request with one or two fields fuzzed: reaches deeper code."""
    request = pb.GenerateRequest(text=rng.choice(["Hello", "Hi there", "a b c"]))
    request.stopping.max_tokens = rng.choice([1, 2, 3])
    fuzzed = fill(pb.GenerateRequest(), rng)
    for field in rng.sample(list(pb.GenerateRequest.DESCRIPTOR.fields), 2):
        if field.is_repeated:
            request.ClearField(field.name)
            getattr(request, field.name).MergeFrom(getattr(fuzzed, field.name))
        elif field.type == F.TYPE_MESSAGE:
            if fuzzed.HasField(field.name):
                getattr(request, field.name).CopyFrom(getattr(fuzzed, field.name))
        else:
            setattr(request, field.name, getattr(fuzzed, field.name))
    nested = [f for f in pb.GenerateRequest.DESCRIPTOR.fields
              if f.type == F.TYPE_MESSAGE and not f.is_repeated]  # fmt: skip
    if rng.random() < 0.6:  # a few knobs of one nested message (sampling, stopping, output...)
        fill(getattr(request, rng.choice(nested).name), rng, depth=3)
    if request.stopping.max_tokens > 8:
        request.stopping.max_tokens = 3  # keep the calls short
    return request


def valid_request(request_class: type[message.Message]) -> message.Message:
    """A request the method serves, for the oversized field to go into."""
    if request_class is pb.GenerateRequest:
        request = pb.GenerateRequest(text="Hello")
        request.stopping.max_tokens = 2
        return request
    if request_class is pb.EmbedRequest:
        return pb.EmbedRequest(inputs=[pb.EmbedInput(text="Hello")])
    if request_class is pb.TokenizeRequest:
        return pb.TokenizeRequest(text="Hello")
    return request_class()


def repeated_paths(msg: descriptor.Descriptor, depth: int = 0) -> list[list[str]]:
    """The path to every repeated field and map under ``msg`` (through nested messages and
    the entries of repeated ones), to depth 3."""
    paths: list[list[str]] = []
    for field in msg.fields:
        is_message = field.type == F.TYPE_MESSAGE
        is_map = is_message and field.message_type.GetOptions().map_entry
        if field.is_repeated:
            paths.append([field.name])
        if is_message and not is_map and depth < 3:
            paths += [[field.name, *sub] for sub in repeated_paths(field.message_type, depth + 1)]
    return paths


def _entry(field: descriptor.FieldDescriptor, rng: random.Random, huge: bool) -> Any:
    """One plausible entry of a repeated scalar field (1 MiB for a huge string), or None."""
    if field.type == F.TYPE_STRING:
        return rng.choice("ab<{ ") * HUGE_ENTRY_CHARS if huge else rng.choice(["one", "a", "7"])
    if field.type == F.TYPE_BYTES:
        return rng.randbytes(64) * (HUGE_ENTRY_CHARS // 64) if huge else b"x"
    if huge:
        return None
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return rng.choice([0.0, 1.0, -5.0])
    return _scalar(field, rng) if field.type != F.TYPE_UINT32 else rng.choice([1, 5, 7, 299])


def _small_entry(msg: message.Message, rng: random.Random) -> None:
    """Fill ``msg`` with at most ~256 bytes: many of them stay under the message size limit."""
    for _ in range(20):
        msg.Clear()
        fill(msg, rng, depth=3)
        if msg.ByteSize() <= 256:
            return


def _huge_entry(msg: message.Message, rng: random.Random) -> bool:
    """Fill ``msg`` (an entry of a repeated message) with one 1 MiB string; False if it has
    no string field."""
    fill(msg, rng, depth=3)
    strings = [f for f in msg.DESCRIPTOR.fields if f.type == F.TYPE_STRING and not f.is_repeated]
    if not strings:
        return False
    setattr(msg, rng.choice(strings).name, _entry(strings[0], rng, huge=True))
    return True


def oversized(
    request: message.Message, path: list[str], rng: random.Random, huge: bool, first: bool
) -> bool:
    """Set the repeated field at ``path`` of ``request`` to many entries (or to one huge one);
    messages on the way get one entry / are set. ``first``: many copies of the valid request's
    own first entry, if it has one (not random ones). False where the field cannot hold it."""
    target = request
    for name in path[:-1]:
        field = target.DESCRIPTOR.fields_by_name[name]
        target = getattr(target, name)
        if field.is_repeated:
            del target[:]
            target = target.add()
        else:
            target.SetInParent()
    field = target.DESCRIPTOR.fields_by_name[path[-1]]
    container = getattr(target, path[-1])
    count = 1 if huge else rng.choice(MANY_ENTRIES)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        container.clear()
        key_field, value_field = field.message_type.fields
        keys = [f"k{i}" if key_field.type == F.TYPE_STRING else i for i in range(count)]
        if value_field.type == F.TYPE_MESSAGE:  # e.g. a Struct's values
            entry = value_field.message_type._concrete_class()
            if huge and not _huge_entry(entry, rng):
                return False
            if not huge:
                _small_entry(entry, rng)
            for key in keys:
                container[key].CopyFrom(entry)
            return True
        value = _entry(value_field, rng, huge)
        if value is None:
            return False
        container.update(dict.fromkeys(keys, value))
        return True
    template = container[0] if first and len(container) else None
    entries = [] if template is None else [type(template)()]
    for entry in entries:
        entry.CopyFrom(template)
    del container[:]
    if field.type == F.TYPE_MESSAGE:
        entry = entries[0] if entries and not huge else container.add()
        if huge:
            return _huge_entry(entry, rng)
        if not entries:
            _small_entry(entry, rng)
        container.extend([entry] * (count - len(container)))
        return True
    value = _entry(field, rng, huge)
    if value is None:
        return False
    container.extend([value] * count)
    return True


def oversized_cases(rng: random.Random) -> list[tuple[str, bool, bytes, str]]:
    """(method path, streaming, request, what is oversized) for every repeated field."""
    cases = []
    for path, method in methods():
        module = generation_service_pb2 if "Generation" in path else model_service_pb2
        request_class = getattr(module, method.input_type.name)
        for fields in repeated_paths(method.input_type):
            for huge in (False, True):
                for i in range(OVERSIZED_PER_FIELD):
                    request = valid_request(request_class)
                    if oversized(request, fields, rng, huge, first=i == 0):
                        what = f"{'.'.join(fields)} {'huge' if huge else 'many'}"
                        raw = request.SerializeToString()
                        cases.append((path, method.server_streaming, raw, what))
    return cases


def methods() -> list[tuple[str, descriptor.MethodDescriptor]]:
    out = []
    for module, name in ((generation_service_pb2, "GenerationService"),
                         (model_service_pb2, "ModelService")):  # fmt: skip
        service = module.DESCRIPTOR.services_by_name[name]
        out += [(f"/{service.full_name}/{m.name}", m) for m in service.methods]
    return out


def mutate(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 6)):
        choice = rng.random()
        if data and choice < 0.4:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif data and choice < 0.6:
            del data[rng.randrange(len(data)) :]
        elif choice < 0.8:
            data[rng.randrange(len(data) + 1) : 0] = rng.randbytes(rng.randint(1, 12))
        else:  # a field with a huge length prefix or an unknown wire type
            data += bytes([rng.randrange(256), 0xFF, 0xFF, 0xFF, 0xFF, 0x0F])
    return bytes(data)
