from mxd_lens.cli import main


def test_check_runs_and_from_mlp_is_exact(capsys):
    assert main(["check", "--k", "4"]) == 0
    out = capsys.readouterr().out
    lines = [
        line for line in out.splitlines() if "MxD.from_mlp" in line and line.startswith(("gpt2", "gated"))
    ]
    assert len(lines) == 2 and all(line.rstrip().endswith("+0.0000") for line in lines)
