"""The cluster file's schema: every key, its type and what it allows, one msgspec Struct per table.

`read` decodes a file into these Structs and refuses anything else (an unknown key anywhere, a
wrong type, a value out of range, a clash between entries) with one UsageError line that names the
file, the key by its path (`node[2].meta_port`: nodes count from 1, in file order) and what is
allowed, suggesting the key that was probably meant. config.py turns the result into a Cluster.
"""

from __future__ import annotations

import datetime
import difflib
import ipaddress
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from dlfs.errors import UsageError

NODE_NAME = r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z"  # a host name's letters: it is an etcd key and a --name
HOST_NAME = r"\A[A-Za-z0-9_][A-Za-z0-9_.-]*\Z"
ETCD_ENDPOINT = r"\Ahttps?://[^/\s]+/?\Z"
META_PORT, DATA_PORT = 7420, 7421  # where a node's daemons listen unless the file says otherwise

Port = Annotated[int, Meta(ge=1, le=65535, description="a port number from 1 to 65535")]
PathText = Annotated[str, Meta(description="a path, relative to this file")]


class NodeEntry(Struct, forbid_unknown_fields=True, frozen=True):
    """One [[node]] table."""

    name: Annotated[str, Meta(pattern=NODE_NAME, description="a name of letters, digits, '.', '_' and '-'")]
    address: Annotated[str, Meta(min_length=1, description="a host name or IP address without a port; "
                                                           "ports go in meta_port and data_port")]
    meta_port: Port | None = None  # None: the file's meta_port
    data_port: Port | None = None
    role: Annotated[Literal["both", "meta", "data"], Meta(description="data, meta or both")] = "both"


class EtcdSection(Struct, forbid_unknown_fields=True, frozen=True):
    """The [etcd] table: where a cluster of several nodes keeps its control state."""

    endpoints: Annotated[list[Annotated[str, Meta(pattern=ETCD_ENDPOINT)]],
                         Meta(min_length=1, description='["http://HOST:PORT", ...], https:// for TLS')]
    prefix: Annotated[str, Meta(min_length=1, description='a non-empty key prefix such as "/dlfs/"')] = "/dlfs/"
    ca_file: PathText = ""
    cert_file: PathText = ""
    key_file: PathText = ""
    lease_ttl: Annotated[int, Meta(ge=2, le=3600, description="whole seconds from 2 to 3600")] = 10


class ClusterFile(Struct, forbid_unknown_fields=True, frozen=True):
    """The whole file: top-level keys, then the [[node]] tables and [etcd]."""

    node: Annotated[list[Annotated[NodeEntry, Meta(description="a [[node]] table")]],
                    Meta(min_length=1, description="[[node]] tables, one per node")]
    key_file: Annotated[str, Meta(min_length=1, description="the cluster key's path, relative to this file; "
                                                            "`dlfs keygen FILE` makes one")]
    replicas: Annotated[int, Meta(ge=1, description="a whole number from 1 to the number of data nodes")] | None = None
    meta_port: Port = META_PORT  # the default of every [[node]]
    data_port: Port = DATA_PORT
    transport: Annotated[Literal["auto", "tcp", "rdma"], Meta(description="auto, tcp or rdma")] = "auto"
    rdma_device: Annotated[str, Meta(min_length=1, description='a device name such as "mlx5_0"')] | None = None
    rdma_port: Annotated[int, Meta(ge=1, le=255, description="a port number from 1 to 255")] | None = None
    etcd: Annotated[EtcdSection, Meta(description="an [etcd] table")] | None = None


# Where each table's keys go, for a key written in the wrong one (a top-level key after a [[node]]
# header belongs to that node: TOML's most common surprise).
SECTIONS: dict[str, type[Struct]] = {"at the top of the file, before the first table": ClusterFile,
                                     "in each [[node]] table": NodeEntry, "in [etcd]": EtcdSection}


def read(path: Path) -> tuple[ClusterFile, dict[str, Any]]:
    """The file decoded and checked (and its raw TOML document); UsageError (one line) for any mistake."""
    where = f"cluster file {path}"
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{where} does not exist") from None
    except OSError as exc:
        raise UsageError(f"cannot read {where}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{where} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{where} is not valid TOML: {exc}") from None
    try:
        spec = msgspec.convert(doc, ClusterFile)
    except msgspec.ValidationError as exc:
        raise UsageError(f"{where}{_explain(str(exc), doc)}") from None
    problem = _clash(spec)
    if problem:
        raise UsageError(f"{where}{problem}")
    return spec, doc


# --- saying what is wrong -------------------------------------------------------------------------
def _explain(error: str, doc: dict[str, Any]) -> str:
    """msgspec's error ("<what> - at `$.node[0].meta_port`") in the file's terms, after the file's name."""
    what, _, at = error.partition(" - at `$")  # no "at" part: the top level
    steps = re.findall(r"\.(\w+)|\[(\d+)\]", at.removesuffix("`"))
    path = [name or int(index) for name, index in steps]
    types = _types_along(path)
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", what, re.S)
    if unknown:
        return f": unknown key {unknown.group(1)!r}{_in(path)} ({_hint(unknown.group(1), types[-1])})"
    missing = re.fullmatch(r"Object missing required field `(.*)`", what, re.S)
    if missing:
        key = missing.group(1)
        if not path and key == "node":
            return " lists no [[node]] entries"
        allowed = _description(_field_type(types[-1], key))
        return f"{': ' + _in(path).removeprefix(' in ') if path else ''} needs {key} ({allowed})"
    value = _value_at(doc, path)
    if path == ["node"] and value == []:
        return " lists no [[node]] entries"
    allowed = next((d for d in map(_description, reversed(types)) if d), what)
    return f": {_shown(_key(path), value)} (use {allowed})"


def _key(path: list[str | int]) -> str:
    """A key's path as the file would say it: node[2].meta_port (nodes count from 1), etcd.lease_ttl."""
    out = ""
    for step in path:
        out += f"[{step + 1}]" if isinstance(step, int) else f".{step}" if out else step
    return out


def _in(path: list[str | int]) -> str:
    if not path:
        return ""
    return " in [etcd]" if path == ["etcd"] else f" in {_key(path)}"


def _shown(key: str, value: Any) -> str:
    """`key = value` as a user would recognise it; a table or a long list by its kind."""
    if isinstance(value, dict):
        return f"{key} is a table"
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, datetime.date | datetime.time):
        text = value.isoformat()
    else:
        text = repr(value)
    if len(text) > 80:
        return f"{key} is a list" if isinstance(value, list) else f"{key} = {text[:72]}..."
    return f"{key} = {text}"


def _hint(key: str, table: Any) -> str:
    """Where a key that is not allowed here belongs, or the allowed key it is closest to."""
    here = _fields(table)
    for place, other in SECTIONS.items():
        if other is not table and key in _fields(other):
            return f"it goes {place}"
    close = difflib.get_close_matches(key, here, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"allowed: {', '.join(here)}"


def _value_at(doc: Any, path: list[str | int]) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def _unwrap(tp: Any) -> tuple[Any, str]:
    """A type without its Annotated and Optional layers, and the description they carry."""
    description = ""
    while True:
        if typing.get_origin(tp) is Annotated:
            tp, *extras = typing.get_args(tp)
            description = next((m.description for m in extras if isinstance(m, Meta) and m.description), description)
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        else:
            return tp, description


def _description(tp: Any) -> str:
    return _unwrap(tp)[1]


def _fields(table: Any) -> list[str]:
    return list(getattr(_unwrap(table)[0], "__struct_fields__", ()))


def _field_type(table: Any, name: str) -> Any:
    return typing.get_type_hints(_unwrap(table)[0], include_extras=True).get(name)


def _types_along(path: list[str | int]) -> list[Any]:
    """The schema's type at each step of a path, from ClusterFile down."""
    types: list[Any] = [ClusterFile]
    for step in path:
        base = _unwrap(types[-1])[0]
        if isinstance(step, int):
            args = typing.get_args(base)
            types.append(args[0] if args else Any)
        else:
            types.append(_field_type(base, step) or Any)
    return types


# --- what no single key shows ---------------------------------------------------------------------
def _clash(spec: ClusterFile) -> str:
    """The first mistake that involves more than one key (or a value's shape), after the file's name; or ''."""
    seen_names: dict[str, int] = {}
    for i, n in enumerate(spec.node, 1):
        if n.name in seen_names:
            return f": node[{i}].name = {n.name!r} is node[{seen_names[n.name]}]'s name too (use a name no other node has)"
        seen_names[n.name] = i
        if not _is_host(n.address):
            return f": node[{i}].address = {n.address!r} (use {_description(_field_type(NodeEntry, 'address'))})"
    data = sum(n.role != "meta" for n in spec.node)
    if not data or all(n.role == "data" for n in spec.node):
        return ": needs at least one data node and one metadata node (role = data, meta or both)"
    if spec.replicas is not None and spec.replicas > data:
        return f": replicas = {spec.replicas} (use a whole number from 1 to {data}, the number of data nodes)"
    if spec.etcd is not None and bool(spec.etcd.cert_file) != bool(spec.etcd.key_file):
        return ": [etcd]: cert_file and key_file go together (TLS client certificate and its key)"
    if spec.etcd is None and len(spec.node) > 1:
        return (f" has {len(spec.node)} nodes but no [etcd] section: a cluster of more than one node keeps its "
                'catalog in etcd (endpoints = ["http://HOST:2379", ...])')
    listening: dict[tuple[str, int], str] = {}
    for i, n in enumerate(spec.node, 1):
        for key, own, default in (("meta_port", n.meta_port, spec.meta_port), ("data_port", n.data_port, spec.data_port)):
            if n.role != "both" and not key.startswith(n.role):
                continue  # a daemon this node does not run listens nowhere
            port, this = own or default, f"node[{i}].{key}"
            other = listening.setdefault((n.address, port), this)
            if other != this:
                inherited = "" if own else f" (the top-level {key})"
                return (f": {this} = {port}{inherited} clashes with {other}: both listen on {n.address} port {port} "
                        "(use a port no other daemon at that address has)")
    return ""


def _is_host(text: str) -> bool:
    """A host name or an IP address (v6 without brackets), and no port."""
    if ":" not in text:
        return re.match(HOST_NAME, text) is not None
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True
