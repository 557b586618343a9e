#!/bin/sh
# Hydra's "ssh" into a simulated host: MPICH's mpiexec runs it as its launcher
# (mpiexec -launcher ssh -launcher-exec tests/cluster/nsexec.sh) with ssh's arguments:
#     nsexec.sh -x <host> <command words...>
# and it runs the command, as ssh would (words joined, parsed by sh), inside the network namespace
# "$CLUSTER_NS_PREFIX-<host>" and a UTS namespace whose hostname is <host>. Nothing leaves the machine.
set -eu
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
    shift  # ssh options (-x)
done
[ $# -ge 2 ] || { echo "nsexec.sh: usage: nsexec.sh [-x] <host> <command...>" >&2; exit 2; }
: "${CLUSTER_NS_PREFIX:?nsexec.sh: CLUSTER_NS_PREFIX is not set}"
host=$1
shift
case "$host" in
    *[!a-z0-9]*) echo "nsexec.sh: unexpected host name '$host'" >&2; exit 2 ;;
esac
exec ip netns exec "$CLUSTER_NS_PREFIX-$host" unshare --uts sh -c 'hostname "$1" && shift && exec sh -c "$*"' nsexec "$host" "$@"
