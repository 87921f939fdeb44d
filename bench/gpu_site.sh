# Sourced by the bench/gpu_*.sh scripts on a lent GPU host (no internet): installs the carried
# wheels (.gpu/rank: kafka-python, crc32c, protobuf, grpcio, faiss-cpu, prometheus-client,
# tqdm ...; .gpu/whl: fla-core, einops) into S=/tmp/site. Status: pip's.
S=/tmp/site && mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $S \
  .gpu/rank/*.whl .gpu/whl/*.whl
