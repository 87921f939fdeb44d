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


def test_an_unwritable_dead_letter_names_the_record(kafka_config, tmp_path, capsys, monkeypatch):
    import streams.consumer
    from streams.producer import EventProducer

    monkeypatch.setattr(streams.consumer, "DLQ_MAX_REQUEST_BYTES", 64)  # nothing fits
    cfg = kafka_config(partitions=1)
    with EventProducer(cfg) as producer:
        producer.send_raw(b"k", b"\xff\xff")
        producer.flush()
    settings = {
        "kafka.bootstrap_servers": cfg.bootstrap_servers,
        "kafka.topic": cfg.topic,
        "kafka.dead_letter_topic": cfg.dead_letter_topic,
        "kafka.group_id": cfg.group_id,
        "kafka.session_timeout_ms": 3000,
        "kafka.heartbeat_interval_ms": 500,
        "kafka.metrics_port": 0,
        "server.model_dir": tmp_path / "model",
        "checkpoint.dir": tmp_path / "ckpt",
        "state.spill_dir": tmp_path / "spill",
    }
    args = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    assert main(["ingest", "--init-model", *args]) == 3
    err = capsys.readouterr().err
    assert f"record {cfg.topic}/0@0 (reason undecodable)" in err and "Traceback" not in err
