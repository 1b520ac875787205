#!/bin/sh
# Guest-side self test for run-in-vm.sh (runs under dash inside the VM):
#   tests/rxe/run-in-vm.sh [--nodes 2] -- tests/rxe/selftest.sh
# ibv_devinfo, then an RC pingpong on rxe0: between two processes of this guest (1 node) or
# between the two guests (node0 = server, node1 = client). Exits non-zero on failure.

echo "== ibv_devinfo (gid index $RXE_GID_INDEX, ip $RXE_IP)"
ibv_devinfo -d "$RXE_DEV" || exit 1
ibv_devinfo -d "$RXE_DEV" | grep -q PORT_ACTIVE || { echo "selftest: port not active"; exit 1; }

pp() { timeout 120 ibv_rc_pingpong -d "$RXE_DEV" -g "$RXE_GID_INDEX" -n 1000 -s 4096 "$@"; }
client() { # the server may not listen yet: retry while the TCP connect is refused
  i=0
  while :; do
    out=$(pp "$1" 2>&1); rc=$?
    case $out in *"Couldn't connect"*) [ $i -lt 80 ] || break ;; *) break ;; esac
    i=$((i + 1)); sleep 0.25
  done
  echo "$out"
  return "$rc"
}

if [ "$RXE_NODES" = 2 ]; then
  echo "== RC pingpong node$RXE_NODE <-> $RXE_PEER_IP"
  if [ "$RXE_NODE" = 0 ]; then pp; else client "$RXE_PEER_IP"; fi
  rc=$?
else
  echo "== RC pingpong within this guest, to $RXE_IP"
  pp >/tmp/pp-server 2>&1 & srv=$!
  client "$RXE_IP"; rc=$?
  wait $srv || rc=1
  sed 's/^/server: /' /tmp/pp-server
fi
if [ $rc = 0 ]; then echo "selftest: OK"; else echo "selftest: FAILED ($rc)"; fi
exit "$rc"
