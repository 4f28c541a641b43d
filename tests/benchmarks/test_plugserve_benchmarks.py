"""The benchmarks against plugserve itself: bench_one_batch on the CPU, bench_serving over HTTP."""

from __future__ import annotations

import json
import re

from benchmarks import bench_one_batch, bench_serving
from tests.checkpoints import add_mtp_layer, random_hf_model, save_hf_model, tiny_v3_config
from tests.live_server import API_KEY


def test_bench_one_batch_prints_sglang_format_and_writes_json(tmp_path, capsys):
    out = tmp_path / "one_batch.jsonl"
    bench_one_batch.main(["--batch-size", "1", "3", "--input-len", "32", "--output-len", "6",
                          "--result-filename", str(out)])
    printed = capsys.readouterr().out
    assert printed.count("Prefill. latency:") == 3  # warm-up + two runs
    assert re.search(r"Decode\.  median latency: [\d.]+ s, median throughput: +[\d.]+ token/s", printed)
    assert re.search(r"Total\. latency: [\d.]+ s, throughput: +[\d.]+ token/s", printed)
    # It says where its runner differs from the server's: it raises --max-running-requests to its largest batch.
    assert re.search(r"differs from `plugserve serve` with these flags in: .*--max-running-requests 3 \(given: None\)",
                     printed)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 3]
    assert all(r["prefill_throughput"] > 0 and r["median_decode_latency"] > 0 for r in rows)


def test_bench_one_batch_sizes_the_pool_for_whole_pages(tmp_path):
    """The pool holds every request's tokens in whole pages of the largest page size (FlashMLA's 64 pages did not
    fit 32 requests of 288 tokens in 32 * 288 + 64 tokens), plus the pages held back for their next steps."""
    out = tmp_path / "one_batch.jsonl"
    bench_one_batch.main(["--batch-size", "4", "--input-len", "70", "--output-len", "3", "--page-size", "64",
                          "--result-filename", str(out)])
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["batch_size"] == 4 and row["decode_steps"] == 2


def test_bench_one_batch_times_decode_under_the_overlap_scheduler(tmp_path):
    """--overlap: one interval between consecutive scheduler calls per decode step, output_len - 1 of them."""
    out = tmp_path / "one_batch.jsonl"
    bench_one_batch.main(["--batch-size", "2", "--input-len", "16", "--output-len", "5", "--overlap",
                          "--result-filename", str(out)])
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["overlap"] is True and row["decode_steps"] == 4 and row["median_decode_latency"] > 0


def test_bench_one_batch_builds_the_deterministic_runner_the_server_builds(tmp_path):
    """--enable-deterministic-inference reaches the runner: its cost is the same command without it."""
    out = tmp_path / "one_batch.jsonl"
    bench_one_batch.main(["--batch-size", "2", "--input-len", "16", "--output-len", "3",
                          "--enable-deterministic-inference", "--result-filename", str(out)])
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["server_args"]["enable_deterministic_inference"] is True and row["decode_steps"] == 2


def test_bench_one_batch_reports_the_accept_length_of_speculative_decoding(tmp_path, capsys):
    """Each decode step is a speculative round: they run until the requests are done, the accept length beside."""
    directory = save_hf_model(random_hf_model(tiny_v3_config()), tmp_path / "v3-nextn")
    add_mtp_layer(directory, num_layers=3)
    out = tmp_path / "one_batch.jsonl"
    bench_one_batch.main(["--model-path", str(directory), "--speculative-algorithm", "NEXTN",
                          "--speculative-num-steps", "2", "--batch-size", "2", "--input-len", "16", "--output-len", "9",
                          "--result-filename", str(out)])
    assert re.search(r"Decode\.  median latency: [\d.]+ s, throughput: +[\d.]+ token/s, accept length: [\d.]+",
                     capsys.readouterr().out)
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert 1 <= row["accept_length"] <= 3 and row["decode_steps"] <= 8 and row["decode_throughput"] > 0


def test_bench_one_batch_runs_tensor_parallel_ranks(tmp_path, capsys):
    """--tp-size 2 --ep-size 2 on the tiny preset: rank 0 here, rank 1 a worker process over gloo."""
    out = tmp_path / "one_batch.jsonl"
    bench_one_batch.main(["--model-preset", "tiny", "--load-format", "dummy", "--tp-size", "2", "--ep-size", "2",
                          "--batch-size", "2", "--input-len", "8", "--output-len", "3", "--result-filename", str(out)])
    assert capsys.readouterr().out.count("Prefill. latency:") == 2  # warm-up + the run
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["server_args"]["tp_size"], row["server_args"]["ep_size"]) == (2, 2)
    assert row["batch_size"] == 2 and row["decode_steps"] == 2
    assert row["prefill_throughput"] > 0 and row["median_decode_latency"] > 0 and row["overall_throughput"] > 0
    assert row["backends"]["moe:decode"] == "torch_ref"


def test_bench_one_batch_runs_dp_attention_groups(tmp_path):
    """--enable-dp-attention --dp-size 2: the requests spread over both groups (rank 1 a worker over gloo), whose
    follower ran group 1's part of every forward (it died on the first one when rank 0 sent group 0's alone)."""
    out = tmp_path / "one_batch.jsonl"
    bench_one_batch.main(["--model-preset", "tiny", "--load-format", "dummy", "--tp-size", "2", "--enable-dp-attention",
                          "--dp-size", "2", "--batch-size", "2", "--input-len", "8", "--output-len", "3",
                          "--result-filename", str(out)])
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["server_args"]["dp_size"] == 2 and row["batch_size"] == 2 and row["decode_steps"] == 2


def test_bench_serving_against_the_running_server(server, tmp_path, capsys):
    out = tmp_path / "serving.jsonl"
    code = bench_serving.main(["--base-url", server.base_url, "--api-key", API_KEY, "--num-prompts", "12",
                               "--random-input-len", "48", "--random-output-len", "8", "--random-range-ratio", "0.5",
                               "--max-concurrency", "4", "--output-file", str(out), "--disable-tqdm"])
    assert code in (None, 0)
    printed = capsys.readouterr().out
    for label in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Mean TTFT (ms):", "P99 ITL (ms):", "Median TPOT (ms):", "Concurrency:"):
        assert label in printed
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["completed"] == 12 and row["failed"] == 0
    assert row["server_args"]["model_preset"] == "tiny" and row["server_args"]["tp_size"] == 1
    # ignore_eos makes every request generate exactly its max_tokens
    assert row["output_lens"] == row["max_tokens"]
