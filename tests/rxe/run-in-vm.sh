#!/usr/bin/env bash
# run-in-vm.sh - run a program inside a throw-away QEMU guest that has soft-RoCE (rdma_rxe).
#
# The host kernel needs no RDMA: the guest boots Debian's own kernel package (it ships
# rdma_rxe.ko) with a small busybox initramfs carrying libibverbs + the rxe provider,
# ibverbs-utils, perftest and iproute2. Everything comes from `apt-get download` (nothing is
# installed on the host) and is cached; a run only appends a small payload archive (PROGRAM,
# its shared libraries, -f files, environment) to the cached initramfs and boots it.
# See tests/rxe/README.md.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: tests/rxe/run-in-vm.sh [options] -- PROGRAM [ARGS...]
  --nodes N     1 (default) or 2 guests joined by a virtual Ethernet link (10.0.3.1 / 10.0.3.2);
                PROGRAM runs on both
  -t SECS       wall limit per VM, boot included (default 900)
  -m MEM        guest memory (default 2G)       -s N   guest CPUs (default 2)
  -e VAR=VALUE  export to PROGRAM (repeatable)
  -f PATH       copy a host file into the guest working dir, which is on PATH (repeatable);
                executables get their non-base shared libraries copied too
  --check       say whether the harness can run here (exit 0) or why not (exit 1)
  --build-only  only download/build the cached image (re-resolves the Debian kernel package)
PROGRAM: a host executable (copied with its shared libraries), a shell script (run by dash),
or the name of a tool that only exists in the guest (e.g. ibv_devinfo).
Guest env: RXE_DEV RXE_GID_INDEX RXE_IP RXE_NODE RXE_NODES [RXE_PEER_IP]; cwd = payload dir.
Exit status: PROGRAM's (2 nodes: node0's, else node1's); 124 VM timed out; 125 setup failure.
Cache: $GRADWIRE_RXE_CACHE or <repo>/target/rxe-vm. Kernel package: $GRADWIRE_RXE_KPKG.
EOF
}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${GRADWIRE_RXE_CACHE:-$(dirname "$(dirname "$HERE")")/target/rxe-vm}
NODES=1 TIMEOUT=900 MEM=2G SMP=2 MODE=run
ENVS=() FILES=()

log() { echo "rxe-vm: $*" >&2; }
die() { log "error: $*"; exit 125; }

while [ $# -gt 0 ]; do
  case $1 in
    --nodes|-t|-m|-s|-e|-f) [ $# -ge 2 ] || die "$1 needs a value" ;;&
    --nodes) NODES=$2; shift 2 ;;
    -t) TIMEOUT=$2; shift 2 ;;
    -m) MEM=$2; shift 2 ;;
    -s) SMP=$2; shift 2 ;;
    -e) [[ $2 =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "-e wants VAR=VALUE, got '$2'"; ENVS+=("$2"); shift 2 ;;
    -f) [ -e "$2" ] || die "-f: no such file: $2"; FILES+=("$2"); shift 2 ;;
    --check) MODE=check; shift ;;
    --build-only) MODE=build; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) break ;;
  esac
done
[[ $NODES =~ ^[12]$ ]] || die "--nodes must be 1 or 2"
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "-t wants seconds"
[ "$MODE" != run ] || [ $# -ge 1 ] || { usage >&2; exit 125; }

# ------------------------------------------------------------------------------ guest image
# Debian packages unpacked into the image (the kernel package is added to these).
PKGS=(busybox-static dash iproute2 libibverbs1 ibverbs-providers ibverbs-utils librdmacm1 perftest
      libibumad3 libpci3 libudev1 libnl-3-200 libnl-route-3-200 libmnl0 libbsd0 libmd0 libcap2
      libbpf1 libelf1 zlib1g)
# Kernel modules to load, in this order; their dependencies come along via modules.dep.
MODULES="virtio_pci virtio_net crc32_generic ib_core ib_uverbs rdma_rxe rdma_ucm"
ML=usr/lib/x86_64-linux-gnu   # multiarch library dir (guest and Debian host)

# /init of the guest, run by dash as PID 1. The host passes gw_* words on the kernel command
# line; the kernel hands unknown name=value words to init as environment variables.
read -r -d '' GUEST_INIT <<'EOF' || true
#!/bin/sh
export PATH=/usr/bin HOME=/root TERM=dumb   # PROGRAM writes to a serial tty: no colours
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts
for d in /dev/shm /tmp /run; do mount -t tmpfs tmpfs $d; done
hostname "rxe-node$gw_node"   # distinct per VM: programs may tell hosts apart by name
# ttyS0 is the console (kernel + setup log); ttyS1 carries only PROGRAM's output and the
# exit marker, so the host needs no filtering of boot noise.
stty -F /dev/ttyS1 raw -echo; exec 3>/dev/ttyS1
fail() { echo "rxe-vm: SETUP FAILED: $*"; dmesg | tail -15; poweroff -f; }
modprobe -a $(cat /etc/gw-modules) || fail "modprobe"
ip link set lo up && ip link set eth0 up && ip addr add "$gw_ip/24" dev eth0 || fail "eth0 setup"
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add rxe0"
# Index of the RoCE v2 GID holding the IPv4-mapped address. rxe has 1024 GID slots: one grep
# over all of them (a read per slot costs seconds under TCG). A wrong index shows up later
# as completion error 12 (retry exceeded), so find it here once.
want=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' $(echo "$gw_ip" | tr . ' '))
p=/sys/class/infiniband/rxe0/ports/1 gid= i=0
while [ $i -lt 100 ]; do
  for f in $(grep -lx "$want" $p/gids/* 2>/dev/null); do
    [ "$(cat $p/gid_attrs/types/${f##*/})" = "RoCE v2" ] && gid=${f##*/}
  done
  [ -n "$gid" ] && grep -q ACTIVE $p/state && break
  i=$((i + 1)); sleep 0.1
done
[ -n "$gid" ] || fail "no RoCE v2 GID for $gw_ip on rxe0 (port: $(cat $p/state))"
export RXE_DEV=rxe0 RXE_GID_INDEX=$gid RXE_IP=$gw_ip RXE_NODE=$gw_node RXE_NODES=$gw_nodes
if [ -n "${gw_peer:-}" ]; then   # both VMs boot in parallel: wait for the other one
  export RXE_PEER_IP=$gw_peer; i=0
  until ping -c1 -W1 "$gw_peer" >/dev/null 2>&1; do
    i=$((i + 1)); [ $i -lt 300 ] || fail "peer $gw_peer does not answer ping"
  done
fi
echo "rxe-vm: rxe0 ready, gid index $gid, ip $gw_ip, uptime $(cut -d' ' -f1 /proc/uptime)s"
ulimit -l unlimited
cd /gw/run && sh /gw/job </dev/null >&3 2>&3
printf '@@GW-RC=%s@@\n' $? >&3
poweroff -f
EOF

# Newest .deb of package $1 in the cache.
deb_of() { compgen -G "$CACHE/debs/${1}_*.deb" | sort | tail -n 1; }

fetch_debs() { # download the packages not in the cache yet
  local need=() p
  for p in "$@"; do [ -n "$(deb_of "$p")" ] || need+=("$p"); done
  [ ${#need[@]} -gt 0 ] || return 0
  log "apt-get download ${need[*]}"
  mkdir -p "$B/dl" "$CACHE/debs"
  # Missing or stale package lists are the usual failure: refresh them once, then retry.
  if ! (cd "$B/dl" && apt-get -q download "${need[@]}") >"$B/apt.log" 2>&1; then
    grep -qE 'Unable to locate|no installation candidate|404' "$B/apt.log" || { cat "$B/apt.log" >&2; die "apt-get download failed"; }
    log "apt-get update (package lists missing or stale)"
    apt-get -q update >&2 || die "apt-get update failed"
    (cd "$B/dl" && apt-get -q download "${need[@]}") >"$B/apt.log" 2>&1 || { cat "$B/apt.log" >&2; die "apt-get download failed"; }
  fi
  mv "$B"/dl/*.deb "$CACHE/debs/"   # only complete downloads reach the cache
}

build_image() { # -> $IMG: vmlinuz, base.cpio.gz, busybox, libs.txt, versions.txt
  local X=$B/x R=$B/root p kver M f so path
  fetch_debs "$KPKG" "${PKGS[@]}"
  log "building the guest image for $KPKG"
  mkdir -p "$X" "$B/img"
  for p in "$KPKG" "${PKGS[@]}"; do dpkg-deb -x "$(deb_of "$p")" "$X"; done
  kver=$(ls "$X/lib/modules"); M=$X/lib/modules/$kver
  local BB=$X/bin/busybox

  # merged-/usr layout; everything executable lives in /usr/bin
  mkdir -p "$R/usr/bin" "$R/$ML/libibverbs" "$R/usr/lib64" "$R"/{dev,proc,sys,tmp,run,root,etc/libibverbs.d}
  ln -s usr/bin "$R/bin"; ln -s usr/bin "$R/sbin"; ln -s bin "$R/usr/sbin"
  ln -s usr/lib "$R/lib"; ln -s usr/lib64 "$R/lib64"
  # The kernel needs /dev/console before /init runs (devtmpfs is mounted later).
  mknod -m 600 "$R/dev/console" c 5 1 || die "mknod failed (needs root)"
  mknod -m 666 "$R/dev/null" c 1 3

  # Kernel modules: the .deb ships no modules.dep, so generate one to find the dependency
  # closure, then a small one for the guest.
  "$BB" depmod -b "$X" "$kver"
  for p in $MODULES; do
    f=$(grep -E "(^|/)$p\.ko(\.xz|\.gz|\.zst)?:" "$M/modules.dep") || die "module $p not in $KPKG"
    for f in ${f/:/}; do mkdir -p "$R/lib/modules/$kver/${f%/*}"; cp "$M/$f" "$R/lib/modules/$kver/$f"; done
  done
  "$BB" depmod -b "$R" "$kver"
  echo "$MODULES" >"$R/etc/gw-modules"

  # Userspace. dash is /bin/sh: Debian's busybox shell would run its own `ip` applet
  # (no netns/veth, different output) instead of iproute2.
  cp "$X/bin/dash" "$R/usr/bin/dash"; ln -s dash "$R/usr/bin/sh"
  cp "$X/bin/ip" "$X/usr/bin/rdma" "$X"/usr/bin/ibv_* "$X"/usr/bin/ib_* "$R/usr/bin/"
  cp "$BB" "$R/usr/bin/busybox"
  for p in $("$BB" --list); do [ -e "$R/usr/bin/$p" ] || ln -s busybox "$R/usr/bin/$p"; done
  # libibverbs loads the providers named in /etc/libibverbs.d: ship only rxe's.
  cp "$X"/$ML/libibverbs/librxe-rdmav*.so "$R/$ML/libibverbs/"
  cp "$X/etc/libibverbs.d/rxe.driver" "$R/etc/libibverbs.d/"
  # Shared libraries: the unpacked .debs first, the rest (glibc) from the host; host-built
  # programs then find the host's glibc and libgcc_s (Rust unwinding) in the guest.
  while read -r so path; do
    [ "$path" != not ] || die "guest library $so not found"
    cp -L "$path" "$R/$ML/$so"
  done < <(for f in "$R"/usr/bin/* "$R/$ML"/libibverbs/*; do
             [ -L "$f" ] || LD_LIBRARY_PATH="$X/$ML:$X/lib/x86_64-linux-gnu" ldd "$f" 2>/dev/null || true
           done | awk '$2 == "=>" {print $1, $3}' | sort -u)
  for so in libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1 libgcc_s.so.1; do
    cp -L "/$ML/$so" "$R/$ML/"
  done
  cp -L /lib64/ld-linux-x86-64.so.2 "$R/usr/lib64/"
  echo 'root:x:0:0:root:/root:/bin/sh' >"$R/etc/passwd"; echo 'root:x:0:' >"$R/etc/group"
  echo '127.0.0.1 localhost' >"$R/etc/hosts"
  printf '%s\n' "$GUEST_INIT" >"$R/init"; chmod 755 "$R/init"

  (cd "$R" && find . | "$BB" cpio -o -H newc 2>/dev/null) | gzip -1 >"$B/img/base.cpio.gz"
  cp "$X/boot/vmlinuz-$kver" "$BB" "$B/img/"   # busybox packs the per-run payloads
  ls "$R/$ML" >"$B/img/libs.txt"
  for p in "$KPKG" "${PKGS[@]}"; do basename "$(deb_of "$p")"; done >"$B/img/versions.txt"
  mv "$B/img/vmlinuz-$kver" "$B/img/vmlinuz"
  rm -rf "$CACHE"/img-*; mv "$B/img" "$IMG"
  log "image ready in $IMG ($(du -sh "$IMG" | cut -f1))"
}

kernel_pkg() { # the versioned package linux-image-amd64 depends on
  apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'
}

# Cache key: kernel package + hash of everything that goes into the image, so edits rebuild it.
HASH=$(printf '%s\n' "$GUEST_INIT" "${PKGS[*]}" "$MODULES" "$(declare -f build_image fetch_debs)" | sha256sum | cut -c1-12)
image_dir() { echo "$CACHE/img-$1-$HASH"; }

if [ "$MODE" = check ]; then
  for t in qemu-system-x86_64 timeout flock gzip ldd; do
    command -v $t >/dev/null || { echo "rxe-vm: no $t on the host (apt-get install qemu-system-x86)"; exit 1; }
  done
  k=${GRADWIRE_RXE_KPKG:-$(cat "$CACHE/kpkg" 2>/dev/null || true)}
  if [ -n "$k" ] && [ -f "$(image_dir "$k")/base.cpio.gz" ]; then echo "rxe-vm: ready (cached image $(image_dir "$k"))"; exit 0; fi
  [ "$(id -u)" = 0 ] || { echo "rxe-vm: building the guest image needs root (mknod /dev/console)"; exit 1; }
  command -v apt-get >/dev/null || { echo "rxe-vm: no apt-get (Debian host needed)"; exit 1; }
  # No image yet: the first run downloads from the archive, so see whether it answers.
  # shellcheck disable=SC2016 # $(URI) is apt's format, not the shell's
  uri=$(apt-get indextargets --format '$(URI)' 2>/dev/null | head -n 1)
  [[ $uri =~ ^(https?)://([^/:]+)(:([0-9]+))? ]] || { echo "rxe-vm: no apt source configured"; exit 1; }
  port=${BASH_REMATCH[4]:-$([ "${BASH_REMATCH[1]}" = https ] && echo 443 || echo 80)}
  if timeout 5 bash -c "exec 3<>/dev/tcp/${BASH_REMATCH[2]}/$port" 2>/dev/null; then
    echo "rxe-vm: ready (no cached image yet; the first run downloads it from ${BASH_REMATCH[2]})"; exit 0
  fi
  echo "rxe-vm: no cached image and ${BASH_REMATCH[2]}:$port unreachable"; exit 1
fi

B='' W=''
# shellcheck disable=SC2317 # called by the trap
cleanup() {
  local f
  for f in "${W:-/nonexistent}"/pid.*; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "${B:-}" "${W:-}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"; flock 9   # one builder at a time; runs after it only read the image
# Warm runs reuse the recorded kernel package (no apt, works offline); --build-only refreshes it.
KPKG=${GRADWIRE_RXE_KPKG:-}
[ -n "$KPKG" ] || [ "$MODE" = build ] || KPKG=$(cat "$CACHE/kpkg" 2>/dev/null || true)
if [ -z "$KPKG" ]; then
  KPKG=$(kernel_pkg)
  [ -n "$KPKG" ] || { log "apt-get update (no package lists)"; apt-get -q update >&2; KPKG=$(kernel_pkg); }
  [ -n "$KPKG" ] || die "cannot resolve the kernel package of linux-image-amd64"
  echo "$KPKG" >"$CACHE/kpkg"
fi
IMG=$(image_dir "$KPKG")
if [ ! -f "$IMG/base.cpio.gz" ]; then B=$(mktemp -d "$CACHE/build.XXXXXX"); build_image; rm -rf "$B"; fi
exec 9>&-
[ "$MODE" = run ] || exit 0

# ------------------------------------------------------------------------------ payload
# A second cpio archive appended to the image (the kernel unpacks both):
# /gw/run = cwd (PROGRAM, -f files), /gw/lib = their extra shared libraries, /gw/job = script.
W=$(mktemp -d "${TMPDIR:-/tmp}/rxe-vm.XXXXXX")
P=$W/p/gw
mkdir -p "$P/run" "$P/lib"
is_elf() { [ "$(head -c 4 "$1")" = $'\177ELF' ]; }
q() { printf "'%s'" "${1//\'/\'\\\'\'}"; }   # single-quote for sh

add_file() { # copy into /gw/run; an ELF brings the shared libraries the image lacks
  local so arrow path
  cp -rL "$1" "$P/run/"
  is_elf "$1" || return 0
  while read -r so arrow path _; do
    if [ "$arrow" != "=>" ] || grep -qxF "$so" "$IMG/libs.txt"; then continue; fi
    [ "$path" != not ] || die "$1 needs $so, which is not found on the host"
    cp -L "$path" "$P/lib/$so"
  done < <(ldd "$1" 2>/dev/null || true)
}

for f in "${FILES[@]}"; do add_file "$f"; done
PROG=$1; shift
if [ -f "$PROG" ]; then
  add_file "$PROG"
  if is_elf "$PROG"; then CMD=("./${PROG##*/}"); else CMD=(sh "./${PROG##*/}"); fi
elif [[ $PROG != */* ]]; then
  CMD=("$PROG")   # a guest tool such as ibv_devinfo
else
  die "no such program: $PROG"
fi
{ # shellcheck disable=SC2016 # $PATH expands in the guest
  echo 'export PATH=/gw/run:$PATH LD_LIBRARY_PATH=/gw/lib'
  for e in "${ENVS[@]}"; do echo "export ${e%%=*}=$(q "${e#*=}")"; done
  printf 'exec'; for a in "${CMD[@]}" "$@"; do printf ' %s' "$(q "$a")"; done; echo
} >"$P/job"
(cd "$W/p" && find . | "$IMG/busybox" cpio -o -H newc 2>/dev/null) | gzip -1 | cat "$IMG/base.cpio.gz" - >"$W/initrd"

# ------------------------------------------------------------------------------ boot
filter() { # node: show PROGRAM's output (prefixed for 2 nodes), pick out the exit marker
  local line pre=
  [ "$NODES" = 1 ] || pre="[node$1] "
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line%$'\r'}
    if [[ $line =~ ^(.*)@@GW-RC=([0-9]+)@@$ ]]; then
      echo "${BASH_REMATCH[2]}" >"$W/rc.$1"; line=${BASH_REMATCH[1]}
      [ -n "$line" ] || continue
    fi
    printf '%s%s\n' "$pre" "$line"
  done
}

# Two UDP ports for the VMs' link: below the kernel's ephemeral range (never handed out
# unasked) and not in use now, as far as ss tells.
EPHEMERAL_START=$(awk '{print $1}' /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
[ "${EPHEMERAL_START:-0}" -gt 12000 ] 2>/dev/null || EPHEMERAL_START=32768
for _ in $(seq 50); do
  PORT=$((10000 + RANDOM % ((EPHEMERAL_START - 10002) / 2) * 2))
  ss -Huan "( sport = :$PORT or sport = :$((PORT + 1)) )" 2>/dev/null | grep -q . || break
done
for ((n = 0; n < NODES; n++)); do
  # cryptomgr.notests: the kernel's crypto self-tests once hung a TCG guest's boot for good
  # (soft lockup in cryptomgr_test) while its peer waited; gradwire needs none of them.
  args="console=ttyS0 quiet panic=-1 cryptomgr.notests gw_ip=10.0.3.$((n + 1)) gw_node=$n gw_nodes=$NODES"
  if [ "$NODES" = 1 ]; then
    net=user,id=n0,restrict=on   # no outside access; only gives eth0 a carrier
  else   # two UDP sockets on 127.0.0.1 carry the Ethernet frames between the VMs
    net=socket,id=n0,localaddr=127.0.0.1:$((PORT + n)),udp=127.0.0.1:$((PORT + 1 - n))
    args+=" gw_peer=10.0.3.$((2 - n))"
  fi
  # TCG, not KVM: a guest hangs under this host's KVM. -cpu max: host-built binaries may use
  # newer instructions.
  initrd=$W/initrd
  # Harness self-test: this node's VM fails to start, as a guest that dies in its boot would.
  [ "${GRADWIRE_RXE_FAIL_NODE:-}" != "$n" ] || initrd=$W/no-such-initrd
  { timeout -k 5 "$TIMEOUT" qemu-system-x86_64 -nodefaults -display none -no-reboot \
      -accel tcg -cpu max -smp "$SMP" -m "$MEM" -kernel "$IMG/vmlinuz" -initrd "$initrd" -append "$args" \
      -netdev "$net" -device "virtio-net-pci,netdev=n0,romfile=,mac=52:54:00:12:34:5$n" \
      -serial "file:$W/console.$n" -serial stdio </dev/null 2>"$W/qemu.$n" &
    echo $! >"$W/pid.$n"; rc=0; wait $! || rc=$?; echo $rc >"$W/exit.$n"; } | { filter $n; touch "$W/drained.$n"; } &
done
# A guest that ends without PROGRAM's exit status (its setup failed, e.g. no answer from the
# peer; its kernel died) leaves the other guest nothing to finish with: stop that one now,
# not at its own limit. A PROGRAM that exited, whatever its status, stops nothing: the
# peer's PROGRAM has its own deadlines to report it. drained.N says that all of node N's
# output, exit marker included, has been read.
if [ "$NODES" = 2 ]; then
  while [ ! -f "$W/drained.0" ] || [ ! -f "$W/drained.1" ]; do
    for n in 0 1; do
      m=$((1 - n))
      if [ -f "$W/drained.$n" ] && [ ! -s "$W/rc.$n" ] && [ ! -f "$W/exit.$m" ] && [ ! -f "$W/stopped.$m" ]; then
        log "node$n ended without its program's exit status: stopping node$m"
        touch "$W/stopped.$m"; kill "$(cat "$W/pid.$m")" 2>/dev/null || true
      fi
    done
    sleep 1
  done
fi
wait

final=
for ((n = 0; n < NODES; n++)); do
  rm -f "$W/pid.$n"
  if [ -s "$W/rc.$n" ]; then rc=$(cat "$W/rc.$n")
  else
    if [ -f "$W/stopped.$n" ]; then rc=125; log "node$n: stopped, its peer ended first (above)"
    elif [[ $(cat "$W/exit.$n" 2>/dev/null) =~ ^(124|137)$ ]]; then rc=124; log "node$n: VM timed out after ${TIMEOUT}s"
    else rc=125; log "node$n: setup failed (qemu: $(tail -n 3 "$W/qemu.$n" | tr '\n' ' '))"; fi
    log "node$n: last console lines:"
    [ -s "$W/console.$n" ] || log "  (none: the kernel logs quietly and /init had not printed yet)"
    tail -n 25 "$W/console.$n" 2>/dev/null | tr -d '\r' | sed 's/^/  | /' >&2 || true
  fi
  [ -n "$final" ] && [ "$final" != 0 ] || final=$rc
done
log "exit status $final, ${SECONDS}s wall"
exit "$final"
