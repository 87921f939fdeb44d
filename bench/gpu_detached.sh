#!/usr/bin/env bash
# Run bench work on a lent GPU host past one device call's 10 minutes: detached, from a
# copy of this tree, its files packed into one archive at the end (a call brings back only
# a few files).
#   bash bench/gpu_detached.sh start 'COMMAND'   # copy the tree to $W/src, run COMMAND
#                                                # there detached with OUT=$W/out
#   bash bench/gpu_detached.sh wait SECONDS      # wait for it (SECONDS at most), then pack
#                                                # $W/out and the driver log: $OUT/results.tgz
set -u
W=/tmp/recmem-detached
case "${1:-}" in
start)
  rm -rf $W && mkdir -p $W/src $W/out && cp -r . $W/src/ || exit 1
  cd $W/src && OUT=$W/out setsid nohup bash -c "$2; echo \$? >$W/rc" >$W/driver.log 2>&1 </dev/null &
  sleep 5; cat $W/driver.log
  ;;
wait)
  end=$((SECONDS + ${2:-500}))
  while [ ! -f $W/rc ] && [ $SECONDS -lt $end ]; do sleep 5; done
  echo "rc: $(cat $W/rc 2>/dev/null || echo still running)"; tail -n 60 $W/driver.log
  tar -czf "${OUT:?}/results.tgz" -C $W out driver.log
  ;;
*)
  echo "usage: $0 start 'COMMAND' | wait SECONDS" >&2; exit 2
  ;;
esac
