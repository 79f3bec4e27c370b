"""The single-file HTML report, rendered in headless Chromium (Debian's ``chromium`` package).

The page is loaded from a file with every host unresolvable; a probe script injected at the top
of ``<head>`` records uncaught errors, failed resource loads and ``console.error`` calls, then at
``load`` measures every figure, clicks a table header and writes what it saw as JSON into the
DOM, which ``--dump-dom`` prints. Skipped, with the reason, only where no Chromium is installed
(``.ci/run`` installs it: ``apt-get install -y chromium``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers import run_record as _run
from tracer.diff.compare import compare_records
from tracer.report.html import comparison_html, write_report
from tracer.report.summary import headline

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), shutil.which("google-chrome"))
                 if p), None)
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install -y chromium)")

PROBE = """<script>
window.__errs=[];
window.addEventListener('error',function(e){var t=e.target;__errs.push(t&&t!==window&&t.outerHTML?'load failed: '+t.outerHTML.slice(0,120):'error: '+e.message);},true);
var __ce=console.error;console.error=function(){__errs.push('console.error: '+Array.prototype.join.call(arguments,' '));__ce.apply(console,arguments);};
window.addEventListener('load',function(){
 var figs=Array.prototype.map.call(document.querySelectorAll('figure'),function(f){var s=f.querySelector('svg');var r=s?s.getBoundingClientRect():{width:0,height:0};return {id:f.id,w:r.width,h:r.height,svg:!!s};});
 var sorted=null,t=document.getElementById('points');
 if(t){var th=t.tHead.rows[0].cells;var col=-1;for(var i=0;i<th.length;i++){if(th[i].textContent==='max abs diff')col=i;}
  if(col>=0){th[col].click();sorted=Array.prototype.map.call(t.tBodies[0].rows,function(r){var v=r.cells[col].getAttribute('data-v');return v===null?null:+v;});}}
 var pre=document.createElement('pre');pre.id='__probe';
 pre.textContent=JSON.stringify({errors:__errs,figures:figs,sorted:sorted,verdict:(document.getElementById('verdict')||{}).textContent,
  overflow:document.documentElement.scrollWidth-window.innerWidth,inner:window.innerWidth});
 document.body.appendChild(pre);});
</script>"""


def render(path, tmp_path, width=1200, height=2000, screenshot=None):
    """Load ``path`` in headless Chromium (no network) and return the probe's JSON and Chromium's stderr."""
    probed = tmp_path / f"probed-{width}.html"
    probed.write_text(path.read_text(encoding="utf-8").replace("<head>", "<head>" + PROBE, 1), encoding="utf-8")
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--host-resolver-rules=MAP * ~NOTFOUND", f"--window-size={width},{height}", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=5000",
            "--enable-logging=stderr", "--v=0"]
    proc = subprocess.run(base + ["--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="__probe">(.*?)</pre>', proc.stdout, re.S)
    assert m, f"the page did not finish loading: {proc.stderr[-2000:]}"
    import html as _html

    if screenshot is not None:
        subprocess.run(base + [f"--screenshot={screenshot}", path.as_uri()], capture_output=True, timeout=120)
    return json.loads(_html.unescape(m.group(1))), proc.stderr


@pytest.fixture
def diverging():
    """Planted: layer 0 and its KV cache identical, layer 1's KV cache 1 ULP off, layer 1 off, logits flip."""
    g = torch.Generator().manual_seed(0)
    emb, l0, l1 = (torch.randn(2, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    kv0, kv1 = (torch.randn(4, 8, generator=g).to(torch.bfloat16) for _ in range(2))
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 1.0, 0.0, 4.9]], dtype=torch.bfloat16)
    kv1b = kv1.clone()
    kv1b.view(torch.int16)[3, 2] += 1
    l1b, lb = l1.clone(), logits.clone()
    l1b[0, 0] += 4.0
    lb[1, 3] = 5.5
    pts = lambda e, a, b, c, d, f: [("model.embed_tokens", "embedding", e), ("model.layers.0.self_attn.kv_cache", "kv_cache", a),  # noqa: E731
                                    ("model.layers.0", "layer", b), ("model.layers.1.self_attn.kv_cache", "kv_cache", c),
                                    ("model.layers.1", "layer", d), ("lm_head", "logits", f)]
    a = _run("A", pts(emb, kv0, l0, kv1, l1, logits))
    b = _run("B", pts(emb.clone(), kv0.clone(), l0.clone(), kv1b, l1b, lb))
    return compare_records(a, b, scenario="prefix-cache", model="planted")


def test_page_is_self_contained(diverging, tmp_path):
    page = comparison_html(diverging)
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert not re.search(r'(src|href)="(https?:)?//', page)
    urls = set(re.findall(r'https?://[^"\s<>]+', page))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}, urls  # XML namespaces only
    assert page.count("<figure") == 3 and page.count("<svg") == 3  # amplification, position heat map, ULP


@needs_browser
def test_report_renders_in_chromium(diverging, tmp_path):
    path = write_report(comparison_html(diverging), tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    probe, stderr = render(path, tmp_path, screenshot=shot)
    assert probe["errors"] == [], probe["errors"]
    assert "Uncaught" not in stderr, stderr[-2000:]
    assert probe["verdict"] == f"verdict: {diverging.verdict()}"
    assert [f["id"] for f in probe["figures"]] == ["fig-amplification", "fig-heatmap", "fig-ulp"]
    assert all(f["svg"] and f["w"] > 100 and f["h"] > 50 for f in probe["figures"]), probe["figures"]
    vals = [v for v in probe["sorted"] if v is not None]  # the click sorted the table ascending by max |diff|
    assert len(vals) == 6 and vals == sorted(vals)
    assert shot.is_file() and shot.stat().st_size > 1000
    dom = path.read_text(encoding="utf-8")
    for _, text in headline(diverging):  # the headline block is on the page, as printed in the terminal
        assert text.split("`")[0][:40].replace("&", "&amp;").replace("'", "&#x27;") in dom


@needs_browser
def test_report_fits_a_phone(diverging, tmp_path):
    path = write_report(comparison_html(diverging), tmp_path / "report.html")
    probe, _ = render(path, tmp_path, width=390, height=844)
    assert probe["errors"] == []
    assert probe["overflow"] <= 0, "the page scrolls sideways on a 390 px screen"
    assert probe["inner"] < 600 and all(0 < f["w"] <= probe["inner"] for f in probe["figures"])


@needs_browser
def test_cli_run_report_and_report_command(tmp_path, cli_env):
    """``tracer run --report`` and ``tracer report TRACE`` (from the stored comparison) both render."""
    trace, r1, r2 = tmp_path / "t.h5", tmp_path / "run.html", tmp_path / "again.html"
    cmd = [sys.executable, "-m", "tracer"]
    proc = subprocess.run(cmd + ["run", "tiny-llama", "--device", "cpu", "--length", "40", "-o", str(trace),
                                 "--report", str(r1)], capture_output=True, text=True, env=cli_env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(cmd + ["report", str(trace), "-o", str(r2)], capture_output=True, text=True, env=cli_env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for page in (r1, r2):
        probe, _ = render(page, tmp_path)
        assert probe["errors"] == [] and probe["verdict"].startswith("verdict: ")
        assert len(probe["figures"]) == 3 and all(f["w"] > 100 and f["h"] > 50 for f in probe["figures"])
    proc = subprocess.run(cmd + ["report", str(trace), "-o", str(r2)], capture_output=True, text=True, env=cli_env,
                          cwd=tmp_path)
    lines = proc.stderr.splitlines()  # without a terminal a slow start may say "report: ... elapsed 2s" first
    assert proc.returncode == 2 and "exists" in lines[-1] and all(x.startswith("report: ") for x in lines[:-1])


@needs_browser
def test_audit_and_sweep_reports_render(tmp_path, cli_env):
    """The audit matrix (``audit --report`` and ``tracer report`` of the audit trace) and the sweep map."""
    cmd = [sys.executable, "-m", "tracer"]
    proc = subprocess.run(cmd + ["audit", "tiny-llama", "--device", "cpu", "--length", "24", "--levels", "0,2",
                                 "-o", str(tmp_path / "a.h5"), "--report", str(tmp_path / "audit.html")],
                          capture_output=True, text=True, env=cli_env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("verdict: ")  # summary first
    proc = subprocess.run(cmd + ["report", str(tmp_path / "a.h5"), "-o", str(tmp_path / "matrix.html")],
                          capture_output=True, text=True, env=cli_env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(cmd + ["sweep", "tiny-llama", "--device", "cpu", "--lengths", "20,24", "-o",
                                 str(tmp_path / "s.h5"), "--report", str(tmp_path / "sweep.html")],
                          capture_output=True, text=True, env=cli_env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for page, n_figures, rows in (("audit.html", 0, "the same call twice"), ("matrix.html", 0, "L0-repeat"),
                                     ("sweep.html", 1, '<td data-v="20">20</td>')):
        probe, _ = render(tmp_path / page, tmp_path)
        assert probe["errors"] == [], (page, probe["errors"])
        assert len(probe["figures"]) == n_figures and all(f["w"] > 100 and f["h"] > 50 for f in probe["figures"])
        assert rows in (tmp_path / page).read_text(encoding="utf-8")
