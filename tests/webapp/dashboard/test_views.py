"""The dashboard's pages and actions: who may see them, what they show, what they change."""

from __future__ import annotations

import base64
import json
import math
import queue
import re
import uuid
from datetime import timedelta

import pytest
import torch
from django.urls import reverse
from django.utils import timezone

from kvservice.blend.controller import LoadingController
from kvservice.chunk import token_ids_sha256
from kvservice.protocol import (
    EVICT_TASK,
    INFERENCE_QUEUE,
    WARM_TASK,
    mark_alive,
    routing,
    worker_alive_key,
)
from kvservice.protocol.codecs import DEFAULT_CODEC
from kvservice.protocol.heartbeat import heartbeat_key, write_heartbeat
from tests.webapp.dashboard.factories import make_answers, make_document
from webapp.dashboard import selectors
from webapp.dashboard.models import DashboardSettings, FidelityAudit
from webapp.dashboard.urls import urlpatterns
from webapp.documents.kv import kv_scope_for
from webapp.documents.models import Chunk, Document
from webapp.redis import redis_client

pytestmark = pytest.mark.django_db

DOCUMENT_URLS = {"document_evict", "document_warm", "document_precompute"}
POST_URLS = {"controller", "audit"} | DOCUMENT_URLS


def _all_urls(document_id: int) -> list[tuple[str, str]]:
    """(method, url) for every route of the dashboard app, so a new one cannot be missed."""
    urls = []
    for pattern in urlpatterns:
        name = pattern.name
        kwargs = {"document_id": document_id} if name in DOCUMENT_URLS else {}
        urls.append(
            ("post" if name in POST_URLS else "get", reverse(f"dashboard:{name}", kwargs=kwargs))
        )
    assert len(urls) == len(POST_URLS) + 1
    return urls


def _inference_messages(queue: str = INFERENCE_QUEUE) -> list[dict]:
    """Celery messages waiting in an inference queue, oldest first; drains it."""
    client = redis_client()
    raw = client.lrange(queue, 0, -1)[::-1]  # kombu pushes on the left
    client.delete(queue)
    found = []
    for item in raw:
        envelope = json.loads(item)
        body = json.loads(base64.b64decode(envelope["body"]))
        found.append({"task": envelope["headers"]["task"], "args": body[0]})
    return found


def test_non_staff_get_403_on_every_page_and_action(client, alice) -> None:
    document = make_document(alice)
    client.force_login(alice)
    for method, url in _all_urls(document.pk):
        response = getattr(client, method)(
            url, {"mode": "fixed", "fixed_ratio": "0.5", "sample_rate": "1", "tier": "cpu"}
        )
        assert response.status_code == 403, (method, url, response.status_code)
        htmx = getattr(client, method)(url, HTTP_HX_REQUEST="true")
        assert htmx.status_code == 403, (method, url, "htmx")
    assert selectors.fixed_recompute_ratio() is None
    assert selectors.audit_sample_rate() == 0.0
    assert redis_client().llen(INFERENCE_QUEUE) == 0
    assert Document.objects.get(pk=document.pk).status == Document.Status.READY


def test_anonymous_users_are_sent_to_log_in(client, alice) -> None:
    document = make_document(alice)
    for method, url in _all_urls(document.pk):
        response = getattr(client, method)(url)
        assert response.status_code == 302, (method, url)
        assert response["Location"].startswith(reverse("login")), url


def _page_with_heartbeat(staff_client, **beat) -> str:
    """The dashboard as staff see it while the worker's last heartbeat carries ``beat``."""
    write_heartbeat(redis_client(), pid=1, model="m", model_loaded=True, **beat)
    try:
        return staff_client.get(reverse("dashboard:index")).content.decode()
    finally:
        redis_client().delete(heartbeat_key())


def test_dashboard_shows_the_engines_kernels_graphs_and_buffers(staff_client) -> None:
    """What the worker's heartbeat says of its engine, as ``NativeRuntime.status`` writes it:
    the kernels from a real choice, the pass graphs' and the buffer pool's own stats."""
    from kvservice.blend.graphs import PassGraphs
    from kvservice.model.kernels import KernelChoice
    from kvservice.store.buffers import BufferPool

    pool = BufferPool(limit_bytes=64 << 20)
    kept = pool.empty((2, 1 << 20), torch.float32)
    del kept
    pool.empty((2, 1 << 20), torch.float32)  # the same buffer, handed out again
    graphs = PassGraphs.__new__(PassGraphs)  # its stats alone: no model to record for
    graphs.recorded, graphs.replays, graphs.failed = {1: None, 2: None}, 1234, "OOM at capture"
    graphs.recording_s = [0.25, 0.5, 0.75]
    choice = KernelChoice("onednn-bf16", "auto", {}, {}, True, torch.bfloat16)
    page = _page_with_heartbeat(
        staff_client, kernels=choice.to_dict(), pass_graphs=graphs.stats(), buffers=pool.stats()
    )
    engine = page.split('id="engine-state"')[1].split("</dl>")[0]
    line = " ".join(re.sub(r"<.*?>", "", engine).split())
    assert "onednn-bf16, attention in bfloat16: the matrix code the worker timed fastest" in line
    assert (
        "2 step shapes recorded (a recording takes 500.0 ms, at most 750.0 ms), replayed "
        "1,234 times; recording stopped: OOM at capture"
    ) in line
    assert "1 buffer kept (8 MiB); 1 of 2 requests for cache memory" in line
    assert "(a prefill's, a batch's) were served from a kept buffer" in line
    assert "CUDA graphs: off" not in page and "handed out again" not in page


def test_dashboard_shows_the_answers_streaming_waiting_and_the_step_budget(staff_client) -> None:
    """The batch's state as ``ContinuousBatcher.stats`` writes it into the heartbeat."""
    from kvservice.serve.batcher import PAUSE_TARGET_S, ContinuousBatcher, StepBudget

    batcher = ContinuousBatcher.__new__(ContinuousBatcher)  # its stats alone: no model
    batcher._jobs, batcher._work = [object()] * 3, object()
    batcher._waiting, batcher._incoming = [object()] * 2, queue.Queue()
    batcher.steps, batcher.slices, batcher.upgrades_skipped, batcher._decode_s = 40, 12, 1, 0.05
    batcher.longest_piece_s, batcher.upgrades_dropped = 0.2, 0
    batcher.slot_allocations, batcher.compactions = 1, 0
    batcher.budget = StepBudget()
    page = _page_with_heartbeat(staff_client, batch=batcher.stats())
    line = " ".join(page.split('id="answering-state"')[1].split("</p>")[0].split())
    assert "3 answers streaming, 2 questions waiting to start, one being read" in line
    slice_ms = (PAUSE_TARGET_S - 0.05) * 1000  # the step's aim less its decode rows
    assert f"for up to {slice_ms:.1f} ms (setting: auto)" in line
    assert "takes 50.0 ms" in line and "1 answer skipped the quality upgrade" in line
    batcher.budget, batcher._jobs, batcher._waiting = StepBudget(math.inf), [], []
    batcher._work = None
    line = (
        _page_with_heartbeat(staff_client, batch=batcher.stats())
        .split('id="answering-state"')[1]
        .split("</p>")[0]
    )
    assert "0 answers streaming, 0 questions waiting to start." in " ".join(line.split())
    assert "as long as they take (setting: off)" in line


def test_dashboard_shows_tiers_controller_and_metrics_from_a_real_heartbeat(
    staff_client, alice, worker_heartbeat
) -> None:
    document = make_document(alice)
    make_answers(alice, document)
    response = staff_client.get(reverse("dashboard:index"))
    assert response.status_code == 200
    page = response.content.decode()
    for tier in worker_heartbeat["store"]["tiers"]:
        assert tier["hits"] > 0  # the fixture's reads were real
        hit_rate = tier["hits"] / (tier["hits"] + tier["misses"])
        row = page.split(f'id="tier-{tier["name"]}"')[1].split("</tr>")[0]
        assert f"{hit_rate:.1%}" in row or f"{hit_rate:.0%}" in row, (tier, row)
        assert f"{tier['hits']} / {tier['misses']}" in row
    decision = worker_heartbeat["controller"]["last_decision"]
    why = page.split('id="last-why"')[1].split("</p>")[0].replace("&#x27;", "'")
    ratio = decision["recompute_ratio"]  # the sentence says what the figures decided
    said = "Every token recomputed" if ratio == 1 else f"{ratio:.0%} of the passages' tokens"
    assert said in why and "r_min" not in why
    assert "inference worker up" in page
    assert page.count("<svg") == 6 and page.count("No data yet") == 1  # no audits yet
    assert "Rivers of Europe" in page and "3 / 3" in page


def test_dashboard_shows_the_kv_bytes_stored_per_token_and_the_compression(
    staff_client, alice, worker_heartbeat, settings
) -> None:
    document = make_document(alice, chunks=3)  # 20 tokens a chunk
    Chunk.objects.filter(document=document).update(kv_bytes=20 * 2_880)
    page = staff_client.get(reverse("dashboard:index")).content.decode()
    stored = page.split('id="stored-kv"')[1].split("</p>")[0]
    ratio = settings.KV_BYTES_PER_TOKEN / 2_880
    assert "for 60 tokens" in stored and "2.81 KiB a token" in stored  # 2,880 B
    assert f"{ratio:.2f}× less than in 16 bits (22.5 KiB a token)" in stored
    assert f'title="KV_CODEC={worker_heartbeat["store"]["codec"]}"' in stored  # the setting
    assert "new passages stored as" in stored and "4-bit keys, 3-bit values" in stored
    row = page.split(f'id="dash-document-{document.pk}"')[1].split("</tr>")[0]
    assert "169 KiB" in row  # 3 x 57,600 B, each chunk's object as stored
    # One figure of bytes a token (and 16 bits' beside it), not the model's KV at its dtype
    assert "KV bytes per token" not in page and page.count("B a token") == 2


SELF_EXPLAINED = {"tier", "document", "owner", "status", "actions", "answer", "when"}


def _text(html: str) -> str:
    return re.sub(r"<.*?>", "", html).lower()


def test_every_figure_on_the_dashboard_has_its_unit_and_a_line_saying_what_it_means(
    staff_client, alice, worker_heartbeat, settings, tmp_path
) -> None:
    document = make_document(alice, chunks=3)
    for answer in make_answers(alice, document)[:2]:
        FidelityAudit.objects.create(
            message=answer, blend_text="a", full_text="b", token_f1=0.5, status="done"
        )
    points = [_curve_point("reuse", 0.0, 0.1, 0.31), _curve_point("full", 1.0, 1.0, 0.0)]
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"curve": points, "env": {"kv_codec": DEFAULT_CODEC}}))
    settings.RATIO_CURVE_PATH = curve
    page = staff_client.get(reverse("dashboard:index")).content.decode()

    tables = page.split('<table class="dash-table')[1:]
    assert len(tables) == 6  # tiers, controller inputs, curve, answers, audits, documents
    for table in tables:
        table, after = table.split("</table>", 1)
        if "<thead>" not in table:  # the controller's inputs: a header a row
            headers = re.findall(r"<tr><th>(.*?)</th>", table)
        else:
            headers = re.findall(r"<th>(.*?)</th>", table.split("</thead>")[0])
        meanings = after.split('<dl class="meanings"', 1)[1].split("</dl>")[0]
        terms = [_text(term) for term in re.findall(r"<dt>(.*?)</dt>", meanings)]
        for header in headers:
            name = _text(header)
            if "bandwidth" in name:  # a row per tier, one line for them all
                name = "bandwidth"
            explained = any(term in name or name in term for term in terms)
            assert name in SELF_EXPLAINED or explained, f"no meaning for {header!r}: {terms}"
        assert all(dd.strip() for dd in re.findall(r"<dd>(.*?)</dd>", meanings))

    cpu = page.split('id="tier-cpu"')[1].split("</tr>")[0]
    hits = next(t for t in worker_heartbeat["store"]["tiers"] if t["name"] == "cpu")
    assert f"{hits['hits']} / {hits['misses']} reads" in cpu  # chunk reads, not "558 hits"
    assert re.search(r"<td>\d+ chunks</td>", cpu)  # entries and evictions
    inputs = page.split('id="controller-inputs"')[1].split("</table>")[0]
    assert "768,000 tokens × layers a second" in inputs  # 512 tokens x 30 layers in 0.02 s
    assert "chosen before the worker had measured" not in page  # it decided after measuring


def test_a_decision_made_before_the_throughput_was_measured_says_so(staff_client) -> None:
    controller = LoadingController(r_min=0.15)
    controller.choose(num_tokens=1500, num_layers=30, load_bytes_by_tier={"cpu": 2**20})
    controller.observe_recompute(tokens=512, layers=30, seconds=0.02)  # measured after it
    page = _page_with_heartbeat(staff_client, controller=controller.snapshot())
    why = page.split('id="last-why"')[1].split("</p>")[0]
    assert "768,000" in page  # measured after the decision: said once, not contradicted
    assert "no measurement" not in page and "chosen before the worker had measured" in why


# The team's numbered working sessions ("stop 45", files named "h100_s45_..."): dates mean
# something to an operator, these do not.
INTERNAL_WORDING = re.compile(r"\bstop \d+|\bs\d\d\b|_s\d\d_", re.IGNORECASE)


def test_the_dashboard_speaks_of_dates_not_internal_steps(staff_client, settings) -> None:
    settings.RATIO_CURVE_PATH = settings.BASE_DIR / "docs" / "ratio_curve.json"
    page = staff_client.get(reverse("dashboard:index")).content.decode()
    panel = page.split('id="ratio-curve"')[1].split("</section>")[0]
    assert panel.count("series-note") == 3  # a line on how each of the three was measured
    assert "2026-11-26" in panel and not INTERNAL_WORDING.search(panel)


def _curve_point(label: str, ratio: float, ttft: float, kl: float) -> dict:
    return {
        "label": label,
        "ratio": ratio,
        "ttft_median_s": ttft * 3.0,
        "ttft_ratio_to_full": ttft,
        "tf_kl_mean": kl,
        "tf_kl_median": kl * 0.7,
        "tf_kl_ci95": [kl * 0.8, kl * 1.3],
        "tf_agreement": 1 - kl,
        "tf_logprob_gap_mean": kl / 2,
    }


def test_dashboard_draws_the_measured_ratio_curve(staff_client, settings, tmp_path) -> None:
    points = [
        _curve_point("reuse", 0.0, 0.1, 0.3125),
        _curve_point("blend@0.05", 0.05, 0.2, 0.0875),
        _curve_point("blend@0.15", 0.15, 0.3, 0.0431),
        _curve_point("full", 1.0, 1.0, 0.0),
    ]
    path = tmp_path / "measured" / "curve.json"
    path.parent.mkdir()
    env = {"first_example": 20, "kv_codec": DEFAULT_CODEC}
    path.write_text(json.dumps({"modes": {}, "curve": points, "env": env}))
    settings.RATIO_CURVE_PATH = path
    page = staff_client.get(reverse("dashboard:index")).content.decode()
    panel = page.split('id="ratio-curve"')[1].split("</section>")[0]
    assert "Quality against speed (measured)" in panel and str(path) in panel
    svg = panel.split("<svg")[1].split("</svg>")[0]
    assert svg.count('class="marker ') == 4 and "blend-line" in svg
    rows = panel.split("<tbody>")[1].split("</tbody>")[0]
    for label, kl in [
        ("reuse", "0.3125"),
        ("blend@0.05", "0.0875"),
        ("blend@0.15", "0.0431"),
        ("full", "0.0000"),
    ]:
        assert f'<th scope="row">{label}</th>' in rows and kl in rows
    assert "No curve has been measured" not in panel
    assert page.count("<svg") == 7  # the answers' six charts and the curve


def test_dashboard_draws_a_curve_per_codec_and_names_the_one_the_store_writes(
    staff_client, settings, tmp_path, monkeypatch
) -> None:
    kivi = [
        _curve_point("reuse", 0.0, 0.1, 0.3125),
        _curve_point("blend@0.05", 0.05, 0.2, 0.0875),
        _curve_point("full", 1.0, 1.0, 0.0),
    ]
    fp16 = [
        _curve_point("reuse", 0.0, 0.3, 0.2941),
        _curve_point("blend@0.05", 0.05, 0.4, 0.0811),
        _curve_point("full", 1.0, 1.0, 0.0),
    ]
    primary = settings.RATIO_CURVE_PATH  # tmp_path / "ratio_curve.json" (conftest)
    primary.write_text(json.dumps({"curve": kivi, "env": {"kv_codec": "kivi4k3v"}}))
    note = "TTFT taken on a busy machine"
    primary.with_name("ratio_curve_fp16.json").write_text(
        json.dumps({"curve": fp16, "env": {"kv_codec": "fp16"}, "note": note})
    )
    monkeypatch.setenv("KV_CODEC", "kivi4k3v")

    def panel() -> str:
        page = staff_client.get(reverse("dashboard:index")).content.decode()
        return page.split('id="ratio-curve"')[1].split("</section>")[0]

    shown = panel()
    svg = shown.split("<svg")[1].split("</svg>")[0]
    assert svg.count('data-codec="kivi4k3v"') == 3 and svg.count('data-codec="fp16"') == 2
    assert svg.count("blend-line") == 0  # one blend point a series: nothing to join
    assert "KV stored as 4-bit keys, 3-bit values (in use)" in svg
    assert "KV stored as 16-bit floats (not compressed)<" in svg
    rows = shown.split("<tbody>")[1].split("</tbody>")[0]
    assert rows.count('<tr class="curve-fp16">') == 3 and rows.count('class="curve-kivi4k3v"') == 3
    assert rows.index("0.3125") < rows.index("0.2941")  # the store's codec first
    assert "TTFT taken on a busy machine" not in shown  # the file's note is for engineers
    assert "No curve has been measured" not in shown

    monkeypatch.setenv("KV_CODEC", "int8")  # a codec nobody measured a curve for
    shown = panel()
    assert shown.count('data-codec="fp16"') == 2 and "(in use)" not in shown
    assert "No curve has been measured with the KV as the store keeps it (8-bit integers)" in shown
    assert "KV_CODEC=int8 python -m kvservice.bench" in shown
    assert f"--json {tmp_path / 'ratio_curve_int8.json'}" in shown


def test_dashboard_says_when_no_ratio_curve_was_measured(staff_client, settings, tmp_path) -> None:
    settings.RATIO_CURVE_PATH = tmp_path / "absent.json"
    panel = staff_client.get(reverse("dashboard:index")).content.decode()
    panel = panel.split('id="ratio-curve"')[1].split("</section>")[0]
    assert "No curve has been measured yet" in panel and "<svg" not in panel
    assert "python -m kvservice.bench" in panel and "--ratios 0.05,0.10,0.15,0.25,0.40" in panel
    assert f"--json {tmp_path / 'absent.json'}" in panel

    settings.RATIO_CURVE_PATH.write_text(json.dumps({"modes": {}}))  # a run without --ratios
    panel = staff_client.get(reverse("dashboard:index")).content.decode()
    panel = panel.split('id="ratio-curve"')[1].split("</section>")[0]
    assert "has no &#x27;curve&#x27;" in panel and "<svg" not in panel


def test_htmx_poll_gets_only_the_live_panel(staff_client, worker_heartbeat) -> None:
    response = staff_client.get(reverse("dashboard:index"), HTTP_HX_REQUEST="true")
    page = response.content.decode()
    assert response.status_code == 200
    assert page.startswith('<section id="live"') and "<html" not in page
    assert 'hx-trigger="every' in page and 'id="tier-disk"' in page


def test_dashboard_says_so_when_the_worker_is_down(staff_client) -> None:
    page = staff_client.get(reverse("dashboard:index"), HTTP_HX_REQUEST="true").content.decode()
    assert "inference worker down" in page
    assert "has not reported its store" in page


def test_fixed_ratio_is_stored_and_auto_clears_it(staff_client, staff) -> None:
    response = staff_client.post(
        reverse("dashboard:controller"), {"mode": "fixed", "fixed_ratio": "0.42"}
    )
    assert response.status_code == 302
    assert selectors.fixed_recompute_ratio() == pytest.approx(0.42)
    assert DashboardSettings.objects.get().updated_by == staff
    staff_client.post(reverse("dashboard:controller"), {"mode": "auto"})
    assert selectors.fixed_recompute_ratio() is None


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "abc", ""])
def test_bad_fixed_ratio_is_refused_with_a_message(staff_client, bad) -> None:
    response = staff_client.post(
        reverse("dashboard:controller"), {"mode": "fixed", "fixed_ratio": bad}, follow=True
    )
    assert "recompute ratio must be" in response.content.decode()
    assert selectors.fixed_recompute_ratio() is None


def test_audit_rate_is_stored(staff_client) -> None:
    staff_client.post(reverse("dashboard:audit"), {"sample_rate": "0.25"})
    assert selectors.audit_sample_rate() == 0.25
    response = staff_client.post(reverse("dashboard:audit"), {"sample_rate": "2"}, follow=True)
    assert "between 0 and 1" in response.content.decode()
    assert selectors.audit_sample_rate() == 0.25


def test_evict_and_warm_send_the_documents_kv_keys_to_the_inference_worker(
    staff_client, alice, django_capture_on_commit_callbacks
) -> None:
    document = make_document(alice)
    keys = sorted(document.chunks.values_list("kv_key", flat=True))
    redis_client().delete(INFERENCE_QUEUE)
    with django_capture_on_commit_callbacks(execute=True):
        staff_client.post(reverse("dashboard:document_evict", args=[document.pk]))
        staff_client.post(reverse("dashboard:document_warm", args=[document.pk]), {"tier": "cpu"})
    sent = _inference_messages()
    assert sent == [
        {"task": EVICT_TASK, "args": [keys]},
        {"task": WARM_TASK, "args": [keys, "cpu"]},
    ]
    response = staff_client.post(
        reverse("dashboard:document_warm", args=[document.pk]), {"tier": "s3"}, follow=True
    )
    assert "Cannot warm into tier" in response.content.decode()
    assert _inference_messages() == []


def test_with_several_workers_evict_reaches_each_and_warm_the_documents_home(
    staff_client, alice, django_capture_on_commit_callbacks
) -> None:
    document = make_document(alice)
    keys = sorted(document.chunks.values_list("kv_key", flat=True))
    client = redis_client()
    workers = [f"dash-{uuid.uuid4().hex[:6]}:1" for _ in range(2)]
    for worker in workers:
        mark_alive(client, worker)
        routing.advertise_hot(client, worker, [], INFERENCE_QUEUE)
    scope = kv_scope_for(alice.id)
    digests = [
        routing.chunk_digest(scope, token_ids_sha256(ids))
        for ids in document.chunks.values_list("token_ids", flat=True)
    ]
    home = routing.home_worker(workers, digests)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            staff_client.post(reverse("dashboard:document_evict", args=[document.pk]))
            staff_client.post(
                reverse("dashboard:document_warm", args=[document.pk]), {"tier": "cpu"}
            )
        for worker in workers:
            sent = _inference_messages(routing.worker_queue(worker))
            expected = [{"task": EVICT_TASK, "args": [keys]}]
            if worker == home:
                expected.append({"task": WARM_TASK, "args": [keys, "cpu"]})
            assert sent == expected, worker
        assert _inference_messages() == []  # nothing on the shared queue
    finally:
        for worker in workers:
            client.delete(worker_alive_key(worker), routing.hot_key(worker))


def test_precompute_again_puts_the_document_back_through_the_kv_step(
    staff_client, alice, settings, django_capture_on_commit_callbacks
) -> None:
    document = make_document(alice)
    kv_queue = redis_client()
    before = kv_queue.llen("kv")
    with django_capture_on_commit_callbacks(execute=True):
        staff_client.post(reverse("dashboard:document_precompute", args=[document.pk]))
    document.refresh_from_db()
    assert (document.status, document.stage) == (Document.Status.PROCESSING, Document.Stage.KV)
    assert set(document.chunks.values_list("kv_status", flat=True)) == {Chunk.KVStatus.PENDING}
    batches = -(-document.chunks.count() // settings.KV_PRECOMPUTE_BATCH)
    assert kv_queue.llen("kv") == before + batches
    kv_queue.delete("kv")


def test_django_admin_lists_the_models_and_keeps_measurements_read_only(
    client, django_user_model, alice
) -> None:
    make_answers(alice, make_document(alice))
    admin = django_user_model.objects.create_superuser(username="root", password="root-pass")
    client.force_login(admin)
    for name in (
        "chat_message",
        "chat_conversation",
        "chat_citation",
        "dashboard_fidelityaudit",
        "dashboard_dashboardsettings",
        "documents_chunk",
    ):
        assert client.get(reverse(f"admin:{name}_changelist")).status_code == 200, name
    from webapp.chat.models import Message

    answer = Message.objects.filter(role="assistant").first()
    page = client.get(reverse("admin:chat_message_change", args=[answer.pk])).content.decode()
    assert 'name="ttft_s"' not in page and 'name="recompute_ratio"' not in page
    assert 'name="content"' in page  # moderation of the text stays possible


def test_a_kdn_workers_tiers_are_listed_fastest_first_with_the_api_last() -> None:
    """A worker with KV_SOURCE=kdn reads through the knowledge delivery API in S3's place."""
    beat = {
        "store": {
            "tiers": [
                {"name": "kdn", "hits": 3, "misses": 1, "capacity_bytes": None, "bytes": None},
                {"name": "cpu", "hits": 1, "misses": 3, "capacity_bytes": 100, "bytes": 25},
            ]
        }
    }
    rows = selectors.tier_rows(beat)
    assert [row["name"] for row in rows] == ["cpu", "kdn"]
    assert rows[1]["label"] == "Knowledge delivery API" and rows[1]["hit_rate"] == 0.75
    assert rows[0]["used_fraction"] == 0.25


def test_the_answers_table_gives_the_users_wait_beside_the_workers(alice) -> None:
    """The users' time to the first words (``ttft_seen_s``) and the worker's own, per mode:
    the browser walk found only the worker's (0.42 s p50) where users waited 0.8-7.7 s."""
    make_answers(alice)
    since = timezone.now() - timedelta(days=7)
    blend = next(
        r
        for r in selectors.metrics_summary(selectors.answered_messages(since=since))
        if r["mode"] == "blend"
    )
    assert blend["ttft_p50"] == pytest.approx(0.12) and blend["seen_p50"] == pytest.approx(0.42)
    assert blend["seen_p90"] >= blend["seen_p50"] > blend["ttft_p90"]
