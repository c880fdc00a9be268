"""molt-view: its API over a real socket on run directories written by the real `RolloutLog` (torn ends, a live
run, a resume, requests reaching outside), and its page in headless Chromium on a short run of a tool task."""

import contextlib
import gzip
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from molt_env.trajectory import Trajectory
from molt_train.batch import segment_key
from molt_train.config import LogConfig
from molt_train.group import Group
from molt_train.metrics import Metrics
from molt_train.saved_rollouts import RolloutLog
from molt_train.view.server import make_app

PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJR"
       "U5ErkJggg==")


@contextlib.contextmanager
def serving(*run_dirs):
    """molt-view's app over `run_dirs` on a free port of this machine, in a thread; yields its base URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(list(run_dirs)), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# ----------------------------------------------------------------------
# small runs in the real format


def _trajectory(rollout_id, group_id, reward, messages, segment=0, num_segments=1, truncated=False, info=None):
    prompt, reply = [1, 2, 3, 4], [5, 6, 7]
    return Trajectory(token_ids=prompt + reply, logprobs=[None] * 4 + [-0.1, -2.0, -0.5], mask=[0] * 4 + [1] * 3,
                      versions=[-1] * 4 + [0, 0, 1], reward=reward, rollout_id=rollout_id, group_id=group_id,
                      segment=segment, num_segments=num_segments, finish_reason="length" if truncated else "stop",
                      truncated=truncated, info=info or {}, messages=messages)


def _chat(question, answer):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


TOOL_CHAT = [  # both ways a tool call is saved: OpenAI-style tool_calls, and written in the text (Hermes)
    {"role": "system", "content": "You look things up."},
    {"role": "user", "content": [{"type": "text", "text": "What is in the box?"}, {"type": "image", "image": PNG}]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "open_box", "arguments": "{\"box\": 3}"}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "open_box", "content": "A red ball."},
    {"role": "assistant", "content": "Let me check.\n<tool_call>\n{\"name\": \"weigh\", \"arguments\": {\"item\": "
                                     "\"ball\"}}\n</tool_call>"},
    {"role": "tool", "tool_call_id": "c2", "name": "weigh", "content": "12 g"},
    {"role": "assistant", "content": "A red ball of 12 g."}]


def _step_groups(step):
    """Two prompt groups of three episodes; in group 0 episode 1 has two segments, episode 2 was truncated."""
    groups = []
    for g in range(2):
        trajectories = []
        for e in range(3):
            rollout, reward = f"{step}-{g}-{e}", float(e == 0) + 0.1 * g
            info = {"turns": e + 1, "called": e == 0, "note": "x" * (e + 1), "nested": {"kept": "out of the index"}}
            messages = TOOL_CHAT if (g, e) == (0, 0) else _chat(f"question {g}", f"answer {e}")
            if (g, e) == (0, 1):
                trajectories += [_trajectory(rollout, str(g), reward, _chat(f"question {g}", "first part"),
                                             segment=0, num_segments=2, info=info),
                                 _trajectory(rollout, str(g), reward, messages, segment=1, num_segments=2, info=info)]
            else:
                trajectories.append(_trajectory(rollout, str(g), reward, messages, truncated=(g, e) == (0, 2),
                                                info=info))
        groups.append(Group(index=g, trajectories=trajectories, failures=[]))
    trained = {segment_key(t): {"trained": True, "advantage": t.reward - 0.5, "trainer_logprobs": [None] * 4 + [
        -0.1, -2.01, -0.4]} for group in groups for t in group.trajectories if t.group_id == "0"}
    return groups, trained


def _plays():
    return [{"episode": episode, "sample": 0, "trajectories": [
        _trajectory(f"eval-{episode}-0", str(episode), 1.0, _chat(f"held out {episode}", "yes")).to_dict()]}
        for episode in range(2)]


def _write_step(run_dir, log, step, evaluated=False):
    groups, trained = _step_groups(step)
    log.write(step, groups, _plays() if evaluated else None, trained)
    line = {"step": step, "reward/mean": 0.25 * step, "version": step, "staleness/histogram": {"0": 3}}
    with (run_dir / "metrics.jsonl").open("a") as out:
        out.write(json.dumps(line | ({"eval/reward": 1.0} if evaluated else {})) + "\n")


def _make_run(run_dir: Path, steps=2):
    """A run of `steps` steps (an evaluation at the last) with its tokenizer; returns its `RolloutLog`."""
    from tokenizers import Tokenizer, models

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("env: boxes\nmodel: tiny:agent\nsteps: 5\n")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/reward": 0.5}) + "\n")
    policy = run_dir / "checkpoints" / "step_000001" / "policy"
    policy.mkdir(parents=True)
    vocab = {"<s>": 0, "sys": 1, "tem": 2, "\n": 3, "Q": 4, "A": 5, "B": 6, "C": 7}
    Tokenizer(models.WordLevel(vocab, unk_token="<s>")).save(str(policy / "tokenizer.json"))
    log = RolloutLog(run_dir, LogConfig(rollouts=True, rollouts_every=100))
    for step in range(1, steps + 1):
        _write_step(run_dir, log, step, evaluated=step == steps)
    return log


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """Two steps, with what a run killed while writing leaves: a half metrics line, a torn gzip member, a half
    index line."""
    run_dir = tmp_path_factory.mktemp("view") / "small"
    _make_run(run_dir)
    with (run_dir / "metrics.jsonl").open("a") as out:
        out.write('{"step": 3, "reward/me')
    member = gzip.compress(b'{"step": 3, "split": "train"}\n' * 50)
    with (run_dir / "rollouts" / "steps_000001.jsonl.gz").open("ab") as out:
        out.write(member[:len(member) // 2])
    with (run_dir / "rollouts" / "index.jsonl").open("a") as out:
        out.write('{"step": 3, "file": "steps_000001.jsonl.gz", "off')
    return run_dir


# ----------------------------------------------------------------------
# the API


def test_steps_episodes_paging_sorting_and_one_episode(small_run):
    with serving(small_run) as url, httpx.Client(base_url=url) as client:
        [run] = client.get("/api/runs").json()
        assert (run["name"], run["env"], run["last_step"], run["rollout_steps"]) == ("small", "boxes", 2, [1, 2])
        assert {"reward/mean", "eval/reward", "version"} <= set(run["metric_keys"])
        assert "staleness/histogram" not in run["metric_keys"]  # not a number: no curve
        series = client.get("/api/run/0/metrics", params={"key": ["reward/mean", "eval/reward"]}).json()["series"]
        assert series == {"reward/mean": [[1, 0.25], [2, 0.5]], "eval/reward": [[0, 0.5], [2, 1.0]]}

        listed = client.get("/api/run/0/step/2/episodes").json()
        assert (listed["total"], listed["splits"], listed["pages"]) == (8, {"train": 6, "eval": 2}, 1)
        assert [r["group"] for r in listed["rows"]] == ["0"] * 3 + ["1"] * 3 + ["eval 0", "eval 1"]
        assert listed["groups"]["1"] == {"episodes": 3, "mean_reward": pytest.approx((1.1 + 0.1 + 0.1) / 3)}
        assert listed["info_keys"] == ["called", "note", "turns"]  # the index keeps scalars only
        two_segments = next(r for r in listed["rows"] if r["rollout_id"] == "2-0-1")
        assert (two_segments["segments"], two_segments["tokens"], two_segments["generated"]) == (2, 14, 6)
        assert "where" not in two_segments

        def rollouts(**params):
            return [r["rollout_id"] for r in client.get("/api/run/0/step/2/episodes", params=params).json()["rows"]]

        assert rollouts(split="train", sort="reward", order="desc", page_size=4) == ["2-1-0", "2-0-0", "2-1-1", "2-1-2"]
        assert rollouts(split="train", sort="reward", order="desc", page_size=4, page=1) == ["2-0-1", "2-0-2"]
        assert rollouts(sort="advantage", order="desc") == ["2-0-0", "2-0-1", "2-0-2"] + [
            "2-1-0", "2-1-1", "2-1-2", "eval-0-0", "eval-1-0"]  # untrained last, in their order
        assert rollouts(sort="info.turns", order="desc", split="train")[:2] == ["2-0-2", "2-1-2"]
        assert rollouts(split="eval") == ["eval-0-0", "eval-1-0"]
        assert rollouts(truncated=True) == ["2-0-2"]
        assert rollouts(trained=True, min_reward=0.5) == ["2-0-0"]
        assert rollouts(info="called=true", split="train") == ["2-0-0", "2-1-0"]
        assert rollouts(info="note=xx") == ["2-0-1", "2-1-1"]
        assert rollouts(q="HELD OUT 1") == ["eval-1-0"]
        prompt_id = next(r["prompt_id"] for r in listed["rows"] if r["rollout_id"] == "2-1-2")
        assert rollouts(prompt_id=prompt_id) == ["2-1-0", "2-1-1", "2-1-2"]  # the same opening
        other_step = client.get("/api/run/0/step/1/episodes", params={"prompt_id": prompt_id}).json()["rows"]
        assert [r["rollout_id"] for r in other_step] == ["1-1-0", "1-1-1", "1-1-2"]  # what "compare with" finds

        episode = client.get("/api/run/0/step/2/episode", params={"rollout": "2-0-0"}).json()
        assert (episode["row"]["reward"], episode["held_version"], episode["info"]["nested"]) == (
            1.0, 1, {"kept": "out of the index"})
        [segment] = episode["segments"]
        roles = [m["role"] for m in segment["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
        user, called, _, written = segment["messages"][1:5]
        assert user["parts"] == [{"type": "text", "text": "What is in the box?"}, {"type": "image", "url": PNG}]
        assert called["tool_calls"] == [{"id": "c1", "name": "open_box", "arguments": '{"box": 3}'}]
        assert written["parts"] == [{"type": "text", "text": "Let me check."}]
        assert written["tool_calls"] == [{"id": None, "name": "weigh", "arguments": '{"item": "ball"}'}]
        tokens = segment["tokens"]
        assert tokens["pieces"] == ["sys", "tem", "\n", "Q", "A", "B", "C"]  # the checkpoint's tokenizer
        assert tokens["trainer_logprobs"][4:] == [-0.1, -2.01, -0.4] and tokens["versions"][4:] == [0, 0, 1]
        both = client.get("/api/run/0/step/2/episode", params={"rollout": "2-0-1"}).json()["segments"]
        assert [s["segment"] for s in both] == [0, 1]
        assert both[0]["messages"][-1]["parts"][0]["text"] == "first part"
        evaluated = client.get("/api/run/0/step/2/episode", params={"rollout": "eval-1-0"}).json()
        assert (evaluated["row"]["episode"], evaluated["held_version"]) == (1, 2)


def _raw_get(url, path):
    """GET `path` byte for byte (httpx would resolve `..` before sending it)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("GET", path)
    response = connection.getresponse()
    return response.status, response.read()


def test_requests_reaching_outside_or_malformed_are_refused_with_a_4xx_naming_the_parameter(small_run, tmp_path):
    secret = tmp_path / "steps_000001.jsonl.gz"  # a file of the right shape outside the run's rollouts
    secret.write_bytes(gzip.compress(b'{"secret": true}\n'))
    sneaky = tmp_path / "sneaky"
    _make_run(sneaky, steps=1)
    index = sneaky / "rollouts" / "index.jsonl"
    entry = json.loads(index.read_text().splitlines()[0])
    with index.open("a") as out:
        for step, name in [(7, "../../steps_000001.jsonl.gz"), (8, "/etc/passwd"), (9, "steps_000001.jsonl.gz/..")]:
            moved = {"step": step, "file": name, "offset": 0, "size": secret.stat().st_size}
            out.write(json.dumps(entry | moved) + "\n")
    (sneaky / "rollouts" / "steps_000001.jsonl.gz").rename(sneaky / "rollouts" / "moved")

    with serving(small_run, sneaky) as url:
        for path in ["/api/run/0/../../../etc/passwd", "/api/run/0/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
                     "/..%2f..%2fetc%2fpasswd", "/api/run/0/step/2/..%2F..%2F..%2Fconfig.yaml", "/etc/passwd"]:
            status, body = _raw_get(url, path)
            assert status == 404 and b"root:" not in body, path
        for step in (7, 8, 9):
            status, body = _raw_get(url, f"/api/run/1/step/{step}/episode?rollout=1-0-0")
            assert status == 404 and b"secret" not in body and b"root:" not in body
            assert json.loads(body)["parameter"] == "step"
            assert "not a file of saved rollouts" in json.loads(body)["error"]
        status, body = _raw_get(url, "/api/run/1/step/1/episode?rollout=1-0-0")  # a missing file
        assert status == 404 and "missing" in json.loads(body)["error"]

        bad = {"/api/run/7/step/1/episodes": "run", "/api/run/-1/step/1/episodes": "run",
               "/api/run/x/step/1/episodes": "run", "/api/run/0/step/x/episodes": "step",
               "/api/run/0/step/1.5/episodes": "step", "/api/run/0/step/3/episodes": "step",
               "/api/run/0/step/1/episodes?page=-1": "page", "/api/run/0/step/1/episodes?page=9": "page",
               "/api/run/0/step/1/episodes?page_size=0": "page_size",
               "/api/run/0/step/1/episodes?page_size=100000": "page_size",
               "/api/run/0/step/1/episodes?sort=name": "sort", "/api/run/0/step/1/episodes?sort=info.nested": "sort",
               "/api/run/0/step/1/episodes?order=up": "order", "/api/run/0/step/1/episodes?split=test": "split",
               "/api/run/0/step/1/episodes?min_reward=high": "min_reward",
               "/api/run/0/step/1/episodes?truncated=maybe": "truncated",
               "/api/run/0/step/1/episodes?info=turns": "info", "/api/run/0/step/1/episodes?info=colour=red": "info",
               "/api/run/0/step/1/episode": "rollout", "/api/run/0/step/1/episode?rollout=..%2F..%2Fconfig.yaml":
               "rollout", "/api/run/0/metrics": "key", "/api/run/9/metrics?key=loss": "run"}
        for path, parameter in bad.items():
            status, body = _raw_get(url, path)
            assert 400 <= status < 500 and json.loads(body)["parameter"] == parameter, (path, status, body)


def test_a_live_run_is_read_as_it_writes_and_a_resume_replaces_what_it_dropped(tmp_path):
    run_dir = tmp_path / "live"
    log = _make_run(run_dir, steps=1)
    with serving(run_dir) as url, httpx.Client(base_url=url) as client:
        def summary():
            return client.get("/api/runs").json()[0]

        assert (summary()["last_step"], summary()["rollout_steps"]) == (1, [1])
        with (run_dir / "metrics.jsonl").open("a") as out:  # the next line, half written
            out.write('{"step": 2, "reward/mean": 0.')
        assert summary()["last_step"] == 1
        assert client.get("/api/run/0/step/2/episodes").status_code == 404
        with (run_dir / "metrics.jsonl").open("a") as out:
            out.write('75, "version": 2}\n')
        groups, trained = _step_groups(2)
        log.write(2, groups, _plays(), trained)
        assert (summary()["last_step"], summary()["rollout_steps"]) == (2, [1, 2])
        assert client.get("/api/run/0/metrics", params={"key": "reward/mean"}).json()["series"]["reward/mean"] == [
            [1, 0.25], [2, 0.75]]
        assert client.get("/api/run/0/step/2/episodes").json()["splits"] == {"train": 6, "eval": 2}
        assert client.get("/api/run/0/step/2/episode", params={"rollout": "eval-1-0"}).status_code == 200

        RolloutLog(run_dir, LogConfig(rollouts=True), resume_step=1)  # a resume from step 1 drops step 2 ...
        assert summary()["rollout_steps"] == [1]
        assert client.get("/api/run/0/step/2/episodes").status_code == 404
        groups, trained = _step_groups(2)
        RolloutLog(run_dir, LogConfig(rollouts=True), resume_step=1).write(2, groups[:1], None, trained)  # ... anew
        assert client.get("/api/run/0/step/2/episodes").json()["splits"] == {"train": 3, "eval": 0}
        metrics = Metrics(run_dir, SimpleNamespace(log=LogConfig(tensorboard=False)), resume_step=1)  # rewritten
        metrics.log(2, {"reward/mean": 0.5, "version": 2} | {f"more/{i}": i for i in range(20)})  # in place, longer
        assert client.get("/api/run/0/metrics", params={"key": "reward/mean"}).json()["series"]["reward/mean"] == [
            [1, 0.25], [2, 0.5]]


def test_molt_view_refuses_a_directory_that_is_not_a_run_and_prints_its_url(small_run, tmp_path):
    refused = subprocess.run([sys.executable, "-m", "molt_train.view.server", str(small_run), str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert refused.stderr.strip() == f"molt-view: {tmp_path}: no metrics.jsonl; pass the --out directory of a " \
                                     "molt-train run"
    process = subprocess.Popen([sys.executable, "-m", "molt_train.view.server", str(small_run), "--port", "0"],
                               stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("molt-view: 1 run(s) at http://127.0.0.1:"), line
        url = line.split(" at ")[1].strip()
        assert "<title>molt-view</title>" in httpx.get(url).text
        assert httpx.get(url + "api/runs").json()[0]["rollout_steps"] == [1, 2]
    finally:
        process.terminate()
        process.wait(timeout=30)


# ----------------------------------------------------------------------
# the page, in a browser


@pytest.fixture(scope="module")
def locker_run(tmp_path_factory, ray_address):
    """Three steps of the locker tool task on the tiny agent model, evaluated at the end, rollouts saved."""
    out = tmp_path_factory.mktemp("view") / "locker"
    result = subprocess.run([sys.executable, "-m", "molt_train.cli", "--env", "locker", "--model", "tiny:agent",
                             "--steps", "3", "--rollout.groups_per_step", "4", "--rollout.group_size", "4",
                             "--rollout.max_tokens", "32", "--log.rollouts", "true", "--eval.every", "3",
                             "--eval.episodes", "4", "--train.async_queue_size", "0", "--log.tensorboard", "false",
                             "--ray.address", ray_address, "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def browser():
    missing = [path for path in ("/usr/bin/chromium", "/usr/bin/chromedriver") if not Path(path).exists()]
    if missing:
        pytest.skip(f"no {' or '.join(missing)}: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    yield driver
    driver.quit()


def _drawn(driver, selector):
    """Wait until the page has drawn its current address and `selector` matches; the matches."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def ready(driver):
        done = driver.execute_script("return document.body.dataset.ready === location.hash")
        return done and driver.find_elements(By.CSS_SELECTOR, selector)

    try:
        return WebDriverWait(driver, 30).until(ready)
    except Exception:
        error = driver.find_element(By.ID, "error").text
        raise AssertionError(f"{selector} not drawn at {driver.current_url}; the page says: {error!r}") from None


def test_the_page_goes_from_a_curve_to_a_tool_calling_episode_and_colours_its_tokens(browser, locker_run, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    with serving(locker_run) as url:
        browser.get(url + "/")
        point = _drawn(browser, 'a > circle.pt[data-key="reward/mean"][data-step="3"]')[0]
        point.click()  # inside the point's link
        rows = _drawn(browser, "#episodes tr.episode")
        assert browser.current_url.endswith("#/run/0/step/3?split=train")
        assert browser.find_element(By.ID, "step-title").text == "Step 3"

        listed = httpx.get(f"{url}/api/run/0/step/3/episodes", params={"split": "train"}).json()["rows"]
        assert [row.get_attribute("data-rollout") for row in rows] == [r["rollout_id"] for r in listed]
        episodes = [httpx.get(f"{url}/api/run/0/step/3/episode", params={"rollout": r["rollout_id"]}).json()
                    for r in listed if r["info"].get("tool_calls")]
        assert episodes, "no episode of step 3 called a tool"
        episode = next((e for e in episodes if any(m["role"] == "tool" for m in e["segments"][0]["messages"])),
                       episodes[0])
        messages, tokens = episode["segments"][0]["messages"], episode["segments"][0]["tokens"]
        rollout = episode["row"]["rollout_id"]
        browser.find_element(By.CSS_SELECTOR, f'tr.episode[data-rollout="{rollout}"] a.open-episode').click()

        shown = _drawn(browser, "#pane-a .msg")
        assert [m.get_attribute("data-role") for m in shown] == [m["role"] for m in messages]
        call = next(c for m in messages for c in m["tool_calls"])
        assert call["name"] in [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#pane-a .tool-call .tool-name")]
        for result in (m for m in messages if m["role"] == "tool"):
            texts = [e.text for e in browser.find_elements(By.CSS_SELECTOR, '#pane-a .msg[data-role="tool"] .content')]
            assert result["parts"][0]["text"].strip() in texts

        sampled = browser.find_elements(By.CSS_SELECTOR, "#pane-a .tokens .tok.gen")
        assert len(sampled) == sum(tokens["mask"]) > 0
        assert len(browser.find_elements(By.CSS_SELECTOR, "#pane-a .tokens .tok.ctx")) == tokens["mask"].count(0)
        for span in sampled[:5]:
            assert span.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "transparent")
            assert "engine logprob" in span.get_attribute("title") and "id " in span.get_attribute("title")
        first = tokens["mask"].index(1)
        assert tokens["pieces"][first] in sampled[0].get_attribute("title")

        Select(browser.find_element(By.ID, "color-mode")).select_by_value("staleness")
        _drawn(browser, '#pane-a .tokens[data-mode="staleness"] .tok.gen')
        assert "staleness 0" in browser.find_element(By.CSS_SELECTOR, "#pane-a .tok.gen").get_attribute("title")
        Select(browser.find_element(By.ID, "color-mode")).select_by_value("logprob")
        _drawn(browser, '#pane-a .tokens[data-mode="logprob"] .tok.gen')

        artifacts = Path(os.environ.get("MOLT_TEST_ARTIFACTS") or tmp_path)
        artifacts.mkdir(parents=True, exist_ok=True)
        screenshot = artifacts / "molt-view-episode.png"
        browser.save_screenshot(str(screenshot))
        print(f"molt-view screenshot: {screenshot}")
