"""The recmem command's error handling: clear messages and exit codes, no tracebacks."""

import pytest

from recmem.cli import main
from streams.broker import free_port


@pytest.mark.slow
def test_unreachable_kafka_is_a_clear_error(tmp_path, capsys):
    port = free_port()  # nothing listens there
    csv = tmp_path / "events.csv"
    csv.write_text("user_id,item_id,timestamp\nu1,i1,1000\n")
    rc = main(
        ["produce", "--dataset", f"csv:{csv}", "--topic", "t", "--bootstrap", f"127.0.0.1:{port}"]
    )
    err = capsys.readouterr().err
    assert rc == 3
    assert f"Kafka at 127.0.0.1:{port}" in err and "Traceback" not in err


def test_bad_dataset_and_model_names_are_clear_errors(tmp_path, capsys):
    assert main(["train", "--dataset", "nope", "--out", str(tmp_path / "m")]) == 2
    assert "unknown dataset 'nope'" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("user_id,item\n1,2\n")
    assert main(["train", "--dataset", f"csv:{bad}", "--out", str(tmp_path / "m")]) == 2
    assert "required column 'item_id' is missing" in capsys.readouterr().err
