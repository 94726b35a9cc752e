import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from pyproxy.k8s import manifest
from pyproxy.k8s.manifest import ManifestSource
from pyproxy.k8s.sink import RecordingSink
from pyproxy.model.objects import ZONE_LABEL


def service(name: str, ip: str = "10.96.0.10", port: Any = 80) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"clusterIP": ip, "ports": [{"port": port}]},
    }


def endpoint_slice(name: str, service: str, ip: str = "10.0.0.1") -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip]}],
        "ports": [{"port": 8080}],
    }


def write(path: Path, *docs: dict[str, Any]) -> None:
    """Write `docs` as multi-document YAML, making sure the change is visible in the file's stat."""
    before = path.stat().st_mtime_ns if path.exists() else None
    path.write_text(yaml.safe_dump_all(docs))
    while path.stat().st_mtime_ns == before:  # coarse timestamps: rewrite until mtime moves
        time.sleep(0.01)
        path.write_text(yaml.safe_dump_all(docs))


def cluster_ip(sink: RecordingSink, name: str) -> str:
    return sink.services[f"default/{name}"].cluster_ips[0]


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


def test_a_folder_of_yaml_json_and_lists_is_read_recursively(tmp_path: Path, sink: RecordingSink) -> None:
    write(tmp_path / "web.yaml", service("web"), endpoint_slice("web-1", "web"))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "db.json").write_text(json.dumps(service("db", "10.96.0.20")))
    write(
        tmp_path / "sub" / "list.yml",
        {"apiVersion": "v1", "kind": "List", "items": [service("api", "10.96.0.30")]},
    )
    ManifestSource(tmp_path, sink).load_once()
    assert set(sink.services) == {"default/web", "default/db", "default/api"}
    assert set(sink.slices) == {"default/web-1"}
    assert sink.synced == 1


def test_a_single_file_can_be_the_source(tmp_path: Path, sink: RecordingSink) -> None:
    path = tmp_path / "objects.txt"
    write(path, service("web"))
    ManifestSource(path, sink).load_once()
    assert set(sink.services) == {"default/web"}


def test_only_differences_reach_the_sink(tmp_path: Path, sink: RecordingSink) -> None:
    path = tmp_path / "objects.yaml"
    write(path, service("web"), service("db", "10.96.0.20"))
    source = ManifestSource(path, sink)
    source.load_once()
    sink.calls.clear()

    source.load_once()
    write(path, service("web"), service("db", "10.96.0.20"))  # rewritten, same content
    source.load_once()
    assert sink.calls == []

    write(path, service("web", "10.96.0.11"))
    source.load_once()
    assert sink.calls == [("Service", "default/db", False), ("Service", "default/web", True)]
    assert cluster_ip(sink, "web") == "10.96.0.11"


def test_a_broken_file_keeps_the_previous_services(
    tmp_path: Path, sink: RecordingSink, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "web.yaml"
    write(path, service("web"))
    write(tmp_path / "db.yaml", service("db", "10.96.0.20"))
    source = ManifestSource(tmp_path, sink)
    source.load_once()

    path.write_text("kind: Service\nspec: [unclosed\n")
    write(tmp_path / "db.yaml", service("db", "10.96.0.21"))
    with caplog.at_level(logging.ERROR):
        source.load_once()
    assert set(sink.services) == {"default/web", "default/db"}
    assert cluster_ip(sink, "db") == "10.96.0.21"  # other files still apply
    (record,) = caplog.records
    assert str(path) in record.getMessage()
    assert "line 2" in record.getMessage()  # the parser's own message

    write(path, service("web", "10.96.0.11"))
    source.load_once()
    assert cluster_ip(sink, "web") == "10.96.0.11"


def test_a_broken_json_file_keeps_its_previous_objects(tmp_path: Path, sink: RecordingSink) -> None:
    path = tmp_path / "web.json"
    path.write_text(json.dumps(service("web")))
    source = ManifestSource(tmp_path, sink)
    source.load_once()
    for broken in ('{"kind": "Service",', "[" * 100_000):
        path.write_text(broken)
        source.load_once()
        assert set(sink.services) == {"default/web"}


def test_an_invalid_object_is_skipped_and_its_previous_version_stays(
    tmp_path: Path, sink: RecordingSink, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "objects.yaml"
    write(path, service("web"), service("db", "10.96.0.20"))
    source = ManifestSource(tmp_path, sink)
    source.load_once()

    write(path, service("web", port="80"), service("db", "10.96.0.21"), service("new", port=0))
    with caplog.at_level(logging.ERROR):
        source.load_once()
    assert cluster_ip(sink, "web") == "10.96.0.10"
    assert cluster_ip(sink, "db") == "10.96.0.21"
    assert "default/new" not in sink.services
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert all(str(path) in m and "Service" in m for m in messages)
    assert "default/web" in messages[0] and "spec.ports[0].port must be an integer" in messages[0]
    assert "default/new" in messages[1] and "outside 1-65535" in messages[1]


def test_a_removed_file_removes_its_objects(tmp_path: Path, sink: RecordingSink) -> None:
    write(tmp_path / "web.yaml", service("web"), endpoint_slice("web-1", "web"))
    source = ManifestSource(tmp_path, sink)
    source.load_once()
    (tmp_path / "web.yaml").unlink()
    source.load_once()
    assert sink.services == {} and sink.slices == {}


def test_the_same_object_in_two_files_the_later_path_wins(
    tmp_path: Path, sink: RecordingSink, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path / "a.yaml", service("web", "10.96.0.10"))
    write(tmp_path / "b.yaml", service("web", "10.96.0.11"))
    source = ManifestSource(tmp_path, sink)
    with caplog.at_level(logging.WARNING):
        source.load_once()
    assert cluster_ip(sink, "web") == "10.96.0.11"
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "a.yaml" in record.getMessage()

    (tmp_path / "b.yaml").unlink()
    source.load_once()
    assert cluster_ip(sink, "web") == "10.96.0.10"


def test_hidden_temporary_and_foreign_files_are_ignored(tmp_path: Path, sink: RecordingSink) -> None:
    for name in (".hidden.yaml", ".#web.yaml", "web.yaml~", "web.yaml.swp", "#web.yaml#", "README.md"):
        write(tmp_path / name, service("ghost"))
    (tmp_path / ".git").mkdir()
    write(tmp_path / ".git" / "web.yaml", service("ghost"))
    ManifestSource(tmp_path, sink).load_once()
    assert sink.services == {}


def test_other_kinds_and_empty_documents_are_ignored_and_v1beta1_slices_used(
    tmp_path: Path, sink: RecordingSink
) -> None:
    beta = endpoint_slice("web-1", "web")
    beta["apiVersion"] = "discovery.k8s.io/v1beta1"
    path = tmp_path / "mixed.yaml"
    path.write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n---\n---\n"
        + yaml.safe_dump_all([{**service("web"), "apiVersion": "v2"}, beta, "just a string"])
    )
    ManifestSource(tmp_path, sink).load_once()
    assert sink.services == {}
    assert set(sink.slices) == {"default/web-1"}


@pytest.mark.parametrize("content", [None, "{{{", "- 1\n- 2\n"])
def test_synced_is_marked_once_even_when_nothing_is_usable(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / "bad.yaml").write_text(content)
    sink = RecordingSink()
    source = ManifestSource(tmp_path, sink)
    source.load_once()
    source.load_once()
    assert sink.synced == 1
    assert sink.calls == []


def test_a_missing_path_is_empty_until_it_appears(tmp_path: Path, sink: RecordingSink) -> None:
    folder = tmp_path / "later"
    source = ManifestSource(folder, sink)
    source.load_once()
    assert sink.synced == 1
    folder.mkdir()
    write(folder / "web.yaml", service("web"))
    source.load_once()
    assert set(sink.services) == {"default/web"}


def test_a_manifest_change_is_seen_within_a_second(tmp_path: Path, sink: RecordingSink) -> None:
    path = tmp_path / "web.yaml"
    write(path, service("web"))
    source = ManifestSource(tmp_path, sink, poll_interval=0.05)
    thread = source.start()
    try:
        assert sink.changed.wait(1.0)
        sink.changed.clear()
        started = time.monotonic()
        write(path, service("web", "10.96.0.11"))
        assert sink.changed.wait(1.0)
        assert time.monotonic() - started < 1.0
        assert cluster_ip(sink, "web") == "10.96.0.11"
    finally:
        source.stop()
    assert not thread.is_alive()


def _whole(text: str) -> list[tuple[str, Any]] | str:
    """What a JSON document's objects become when it is decoded whole (or json.loads' error)."""
    try:
        return _normal([manifest._convert(doc) for doc in manifest._flatten([json.loads(text)])])
    except ValueError as e:
        return str(e)


def _normal(outcomes: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [(what, str(o) if what == "invalid" else o) for what, o in outcomes]


def _listed(items: list[Any], **extra: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "List", "items": items, **extra}


GOOD = [service("web"), endpoint_slice("web-1", "web"), {"kind": "ConfigMap"}, service("bad", port="http"), 7]
JSON_DOCUMENTS = [
    json.dumps(_listed(GOOD)),
    json.dumps(_listed(GOOD), indent=2),
    json.dumps(_listed([])),
    json.dumps(_listed([_listed([service("nested")]), service("after")])),
    json.dumps({"items": GOOD, "kind": "List"}),  # kind after items: decoded whole
    json.dumps(_listed(GOOD, metadata={"resourceVersion": "1"})),
    '{"kind": "List", "items": [], "kind": "Service"}',  # duplicate keys: the last one wins
    '{"kind": "List", "items": [1], "items": [2]}',
    json.dumps(service("single")),
    json.dumps([service("array")]),
    json.dumps(_listed(GOOD))[:-30],  # truncated
    json.dumps(_listed(GOOD)) + " {}",  # trailing data
    json.dumps(_listed(GOOD)).replace('"items": [', '"items": [,'),
    ' \n{ "kind" : "ServiceList" ,\n "items" : [ ' + json.dumps(service("spaced")) + " ] } \n",
    '{"kind": "List", "items": {"not": "a list"}}',
    "",
]


@pytest.mark.parametrize("text", JSON_DOCUMENTS)
def test_a_json_list_decoded_item_by_item_reads_as_when_decoded_whole(tmp_path: Path, text: str) -> None:
    path = tmp_path / "objects.json"
    path.write_text(text)
    try:
        streamed: list[tuple[str, Any]] | str = _normal(manifest._parse(path))
    except ValueError as e:
        streamed = str(e)
    assert streamed == _whole(text)


def test_the_usual_json_list_is_decoded_item_by_item() -> None:
    assert manifest._json_list(JSON_DOCUMENTS[0]) is not None
    assert manifest._json_list(JSON_DOCUMENTS[4]) is None  # kind after items: the caller decodes it whole


def node(name: str, zone: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {ZONE_LABEL: zone}}}


def test_the_own_node_is_delivered_and_followed_other_nodes_are_not(tmp_path: Path, sink: RecordingSink) -> None:
    path = tmp_path / "objects.yaml"
    write(path, service("web"), node("node-a", "z1"), node("node-b", "z2"))
    source = ManifestSource(path, sink, node_name="node-a")
    source.load_once()
    assert sink.node is not None and (sink.node.name, sink.node.zone) == ("node-a", "z1")
    sink.calls.clear()
    write(path, service("web"), node("node-a", "z2"), node("node-b", "z3"))
    source.load_once()
    assert sink.calls == [("Node", "node-a", True)]
    assert sink.node is not None and sink.node.zone == "z2"
    write(path, service("web"))
    source.load_once()
    assert sink.node is None
    write(path, service("web"), node("node-a", "z1"))
    nameless = RecordingSink()
    ManifestSource(path, nameless).load_once()  # no node name: every Node is another node's
    assert [c for c in nameless.calls if c[0] == "Node"] == []
