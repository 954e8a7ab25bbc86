"""The command line: plan and compare on small configurations."""

import json

from hulkjax.cli import main


def test_plan_writes_json(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", "--model", "mlp", "--size", "tiny", "--topology", "dgx-h100",
                 "--strategy", "fsdp", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["strategy"] == "fsdp"
    assert "Plan 'fsdp'" in capsys.readouterr().out


def test_compare_compiles_each_strategy_and_reports_collectives(tmp_path, capsys):
    assert main(["compare", "--model", "mlp", "--size", "tiny", "--topology", "dgx-h100",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "all-reduce" in out and "all-gather" in out
    import hulkjax as hj

    # dp_tp needs a 2-D mesh, pipeline several nodes: one DGX node has neither.
    expected = {f"mlp-{s}.json" for s in hj.strategies.names() if s not in ("dp_tp", "pipeline")}
    expected |= {"comparison.png", "graph.png"}
    assert {p.name for p in tmp_path.iterdir()} == expected


def test_compare_rows_equal_compiling_each_plan_alone():
    """``compare`` lowers the SPMD plans on its thread and compiles them on others while it
    builds the staged plans' programs: each row still reads its own plan's program, as that plan
    compiled alone gives it (its collectives and memory per device)."""
    import hulkjax as hj
    from hulkjax.cli import _compare_rows
    from hulkjax.emit.hlo import summarize
    from hulkjax.loading import load_step

    m = load_step("mlp", size="tiny", overrides={})
    state, batch = m.args
    topo = hj.Topology.preset("hetero", nodes=(("A100", 6), ("V100", 2)))
    names = ["dp", "pipeline", "fsdp", "megatron"]
    _, rows = _compare_rows(m.step, state, batch, topo, names, True)
    assert [r["strategy"] for r in rows] == names
    assert rows[1]["plan"].stages is not None  # a staged plan among the SPMD ones
    seen = set()
    for r in rows:
        step = hj.emit(m.step, r["plan"])
        compiled = step.compile(state, batch)
        if r["plan"].stages is None:
            ma = compiled.memory_analysis()
            memory = (ma.argument_size_in_bytes + ma.temp_size_in_bytes
                      + ma.output_size_in_bytes - ma.alias_size_in_bytes)
        else:
            memory = step.memory_per_device()
        alone = summarize(step.collectives(), fold_emulated=True)
        assert (r["collectives"], r["memory"]) == (alone, memory), r["strategy"]
        seen.add(repr(sorted(alone.items())))
    assert len(seen) == len(names)  # rows that read another plan's program would not pass


def test_errors_are_reported_without_a_traceback(capsys):
    assert main(["plan", "--model", "nope", "--size", "tiny"]) == 2
    assert "UnknownModelError" in capsys.readouterr().err


def test_launch_help_lists_local_and_cluster_examples(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["launch", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--processes" in out and "--coordinator" in out and "--process-id" in out
    assert "hulkjax launch --model mlp" in out


def test_launch_runs_two_processes_and_checks_them(tmp_path, capsys):
    import hulkjax as hj

    topo = tmp_path / "grid.json"
    hj.Topology.grid((2, 2), ("proc", "dev")).save(topo)
    out = tmp_path / "run"
    assert main(["launch", "--model", "mlp", "--size", "tiny", "--topology", str(topo),
                 "--strategy", "fsdp", "--processes", "2", "--steps", "2", "--out", str(out),
                 "--timeout", "180"]) == 0
    printed = capsys.readouterr()
    assert "2 processes x 2 cpu devices" in printed.out and "match" in printed.out
    assert "launching 2 processes" in printed.err
    report = json.loads((out / "report.json").read_text())
    assert report["runs"][0]["check"]["match"]
    assert {p.name for p in out.iterdir()} >= {"plan-fsdp.json", "job.json", "report.json",
                                               "worker-0.err", "worker-1.err"}


def test_launch_reports_a_bad_process_count(capsys, tmp_path):
    assert main(["launch", "--topology", "hetero", "--processes", "3",
                 "--out", str(tmp_path)]) == 2
    assert "ProcessLayoutError" in capsys.readouterr().err
