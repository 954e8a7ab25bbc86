"""The GPU-sharded instrument's path, on CPU: a plan's emitted program exported with
``benchmarks/gpu_sharded.py export`` is deserialized, compiled for 8 devices and run by
``benchmarks/gpu_sharded_measure.py`` (its ``--cpu`` mode), with the cost model's prediction in the
manifest beside it."""

import gzip
import json
import os
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_exported_program_compiles_and_runs_for_eight_devices(tmp_path):
    import gpu_sharded

    programs = tmp_path / "programs"
    manifest = gpu_sharded.export(str(programs), families=("gpt2",), strategies=("dp",),
                                  size="tiny", platform="cpu")
    (entry,) = manifest["programs"]
    predicted = entry["predicted"]
    assert predicted["comm_time"] > 0 and predicted["compute_time"] > 0
    # dp's gradients are reduced over every device: the prediction says all-reduces over both axes
    assert {c["kind"] for c in predicted["summary"]} == {"all-reduce"}
    assert predicted["overlapped_step_time"] <= predicted["step_time"] + 1e-12

    out = tmp_path / "out"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_sharded_measure.py"),
                    "--programs", str(programs), "--out", str(out), "--cpu", "--repeats", "2",
                    "--warmup", "1", "--compile-timeout", "300", "--run-timeout", "300",
                    "--collective-mb", "1"],
                   check=True, capture_output=True, timeout=900)
    measured = json.load(open(out / "measured.json"))
    assert measured["devices"] == 8
    (row,) = measured["programs"]
    assert row["name"] == "gpt2-dp" and row["seconds"] > 0 and "error" not in row
    with tarfile.open(out / "hlo.tar") as tar:
        text = gzip.decompress(tar.extractfile("gpt2-dp.hlo.txt.gz").read()).decode()
    assert "all-reduce" in text and "num_partitions=8" in text

    # The probe ran first and its flag set was the one compiled with.
    (probe,) = measured["probes"]  # --cpu tries the first set only
    assert {"client", "lower", "compile", "run"} <= set(probe["phases"])
    assert measured["xla_flags"] == probe["xla_flags"]

    # The report half reads the collectives off the HLO and sets them beside the prediction.
    record = gpu_sharded.digest([str(out)], str(programs))
    (prog,) = record["programs"]
    assert prog["name"] == "gpt2-dp" and prog["predicted"] == predicted
    assert prog["collectives"] and all(c["kind"] == "all-reduce" for c in prog["collectives"])
    assert all(not c["asynchronous"] and c["overlapped"] == 0 for c in prog["collectives"])
    cmp = gpu_sharded.compare(prog)
    assert [(c["kind"], c["axes"]) for c in cmp["cells"]] == [("all-reduce", ["data", "model"])]
    assert cmp["xla_sync"] == len(prog["collectives"])  # XLA:CPU: all synchronous
    text = gpu_sharded.markdown([record], "test")
    assert "| gpt2-dp | all-reduce | data,model |" in text
