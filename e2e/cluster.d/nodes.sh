# Real nodes for e2e/cluster: per node a containerd and a kubelet, plus one
# kube-proxy and the cluster DNS (CoreDNS) for the whole cluster. Sourced by
# e2e/cluster; uses its helpers (start, wait_for, log, die, sign_cert, ...).
#
# The shape, and why:
# - All nodes share this machine's network namespace, mount namespace and
#   filesystem; each has its own node IP (an address on weir0, a
#   bridge without ports), containerd (root, state, socket), kubelet root directory, cgroup
#   root (/weir-node-N in every cgroup v1 hierarchy), pod log directory and CNI
#   bridge with its own pod subnet (weirbrN, 10.244.N.0/24).
# - Pods on different nodes reach each other through this machine's routing
#   table (the bridges are in the same namespace), so no overlay is needed.
# - Because the nodes share one network namespace, one kube-proxy programs the
#   Service rules for all of them (two would rewrite the same iptables chains).
# - The API server listens on HOST_IP (weir0), which pods reach through the
#   `kubernetes` Service; tests on this machine use the same address.
# - Images are never pulled: the project's OCI archives are imported into
#   every node's containerd; any other image fails with ErrImagePull.

HOST_IP=10.250.0.1
NODE_NET=10.250.0.0/24
POD_CIDR=10.244.0.0/16
SERVICE_CIDR=10.96.0.0/16
KUBERNETES_SERVICE_IP=10.96.0.1
DNS_SERVICE_IP=10.96.0.10
CLUSTER_DOMAIN=cluster.local
HOST_IFACE=weir0

node_name_of() { echo "weir-node-$1"; }
node_ip_of() { echo "10.250.0.$((11 + $1))"; }
node_bridge_of() { echo "weirbr$1"; }
node_subnet_of() { echo "10.244.$1.0/24"; }
node_dir_of() { echo "$state/nodes/$(node_name_of "$1")"; }

# cgroup v1 hierarchies mounted on this machine (cpu, memory, pids, ...), and
# the unified v2 mount if any; each node's cgroup root is made in all of them.
cgroup_hierarchies() {
	awk '$3 == "cgroup" || $3 == "cgroup2" {print $2}' /proc/self/mounts
}

# ---------------------------------------------------------------- host network

# Refuse to start on a machine where our ranges already lead somewhere: the
# cluster would capture or break someone else's traffic.
check_ranges_free() {
	local net addr routes
	for net in "$POD_CIDR 10.244.0.1" "$SERVICE_CIDR 10.96.0.1" "$NODE_NET $HOST_IP"; do
		addr=${net#* }
		routes=$(ip -4 route show table all to match "$addr" | grep -v '^default' | grep -v '^broadcast\|^local 127\.' || true)
		[[ -z $routes ]] || die "the range ${net% *} is already routed on this machine ($routes); e2e/cluster needs it for itself (another cluster still up? 'e2e/cluster down' with its WEIR_CLUSTER_DIR)"
	done
	if ip link show "$HOST_IFACE" >/dev/null 2>&1; then
		die "interface $HOST_IFACE exists: another e2e/cluster with nodes runs, or one was not taken down; run 'e2e/cluster down' with its WEIR_CLUSTER_DIR (or 'e2e/cluster down --network' to remove leftovers)"
	fi
}

# Host settings the nodes need; the previous values are kept in the state dir
# and put back by `down`.
host_network_up() {
	local i
	for f in /proc/sys/net/ipv4/ip_forward /proc/sys/net/bridge/bridge-nf-call-iptables; do
		[[ -e $f ]] || { modprobe br_netfilter 2>/dev/null || true; }
		[[ -e $f ]] || die "$f does not exist: the kernel needs bridge netfilter (br_netfilter)"
		echo "$f $(<"$f")" >>"$state/net/sysctl.saved"
		echo 1 >"$f"
	done
	# A bridge without ports, only to hold addresses (this kernel has no
	# dummy interfaces).
	ip link add "$HOST_IFACE" type bridge
	ip addr add "$HOST_IP/32" dev "$HOST_IFACE"
	for ((i = 0; i < NODES; i++)); do ip addr add "$(node_ip_of "$i")/32" dev "$HOST_IFACE"; done
	ip link set "$HOST_IFACE" up
}

# Remove every network object `up` made. Objects are found by name (weir0,
# weirbr*, cni netns of our containerds, kube-proxy's chains), so this also
# cleans up after an `up` whose state directory is gone.
host_network_down() {
	local link f v
	if [[ -n ${K8S_BIN:-} && -x $K8S_BIN/kube-proxy ]] && iptables -t nat -S KUBE-SERVICES >/dev/null 2>&1; then
		log "removing kube-proxy's iptables rules"
		"$K8S_BIN/kube-proxy" --cleanup >/dev/null 2>&1 || true
	fi
	remove_kube_chains
	for link in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | { grep -E "^($HOST_IFACE|weirbr[0-9]+)$" || true; }); do
		log "removing interface $link"
		ip link del "$link" 2>/dev/null || true
	done
	if [[ -f $state/net/sysctl.saved ]]; then
		while read -r f v; do echo "$v" >"$f" 2>/dev/null || true; done <"$state/net/sysctl.saved"
		rm -f "$state/net/sysctl.saved"
	fi
}

# The kubelets' own chains (KUBE-FIREWALL, KUBE-KUBELET-CANARY,
# KUBE-IPTABLES-HINT) and whatever kube-proxy --cleanup or the CNI portmap
# plugin left (KUBE-*, CNI-*): first the jumps into them from the built-in
# chains, then the chains themselves, in every table, for IPv4 and IPv6.
remove_kube_chains() {
	local cmd table rule chain
	for cmd in iptables ip6tables; do
		command -v "$cmd" >/dev/null || continue
		for table in filter nat mangle; do
			{ "$cmd-save" -t "$table" 2>/dev/null || true; } | { grep -E '^-A (INPUT|OUTPUT|FORWARD|PREROUTING|POSTROUTING) .*-j (KUBE|CNI)-' || true; } |
				while read -r rule; do
					# shellcheck disable=SC2086
					eval "$cmd -t $table -D ${rule#-A }" 2>/dev/null || true
				done
			for chain in $("$cmd-save" -t "$table" 2>/dev/null | sed -n 's/^:\(\(KUBE\|CNI\)-[^ ]*\) .*/\1/p'); do
				"$cmd" -t "$table" -F "$chain" 2>/dev/null || true
			done
			for chain in $("$cmd-save" -t "$table" 2>/dev/null | sed -n 's/^:\(\(KUBE\|CNI\)-[^ ]*\) .*/\1/p'); do
				"$cmd" -t "$table" -X "$chain" 2>/dev/null || true
			done
		done
	done
}

# ---------------------------------------------------------------- images

# The images every node has: the sandbox (pause), CoreDNS, and a busybox
# toolbox for tests that read volumes the way a user would (kubectl exec/cp);
# built once per version into the cache. Prints the archive paths.
e2e_images() {
	local dir=$CACHE/k8s/images out
	# shellcheck source=../../scripts/lib/oci-image.sh
	source "$e2e_dir/../scripts/lib/oci-image.sh"
	oci_need_tools
	mkdir -p "$dir"
	local work
	work=$(mktemp -d)
	out=$dir/pause-$K8S_VERSION.oci.tar
	if [[ ! -f $out ]]; then
		log "building image localhost/pause:$K8S_VERSION"
		mkdir -p "$work/pause"
		install -D -m 0755 "$PAUSE_BIN/pause" "$work/pause/pause"
		oci_layer "$work/pause" "$work/pause.tar"
		oci_image "$out" localhost/pause "$K8S_VERSION" "$work/pause.tar" -- \
			--config.user 65535:65535 --config.entrypoint /pause
	fi
	echo "$out"
	out=$dir/coredns-$COREDNS_VERSION.oci.tar
	if [[ ! -f $out ]]; then
		log "building image localhost/coredns:$COREDNS_VERSION"
		mkdir -p "$work/coredns/etc/ssl/certs"
		oci_users "$work/coredns"
		install -D -m 0755 "$COREDNS_BIN/coredns" "$work/coredns/coredns"
		oci_layer "$work/coredns" "$work/coredns.tar"
		oci_image "$out" localhost/coredns "$COREDNS_VERSION" "$work/coredns.tar" -- \
			--config.user 65532:65532 --config.entrypoint /coredns
	fi
	echo "$out"
	out=$dir/toolbox-1.oci.tar
	if [[ ! -f $out ]]; then
		log "building image localhost/weir-e2e-toolbox:1 (busybox from Debian's busybox-static)"
		local deb applet
		deb=$(oci_fetch_debs busybox-static)
		mkdir -p "$work/toolbox-deb" "$work/toolbox/bin"
		dpkg-deb -x "$deb" "$work/toolbox-deb"
		install -m 0755 "$work/toolbox-deb/bin/busybox" "$work/toolbox/bin/busybox"
		for applet in $("$work/toolbox/bin/busybox" --list); do
			[[ $applet == busybox ]] || ln -s busybox "$work/toolbox/bin/$applet"
		done
		oci_users "$work/toolbox"
		oci_layer "$work/toolbox" "$work/toolbox.tar"
		oci_image "$out" localhost/weir-e2e-toolbox 1 "$work/toolbox.tar" -- \
			--config.user 65532:65532 --config.entrypoint /bin/sh --config.env PATH=/bin \
			--config.label "org.opencontainers.image.description=busybox $(oci_deb_version "$deb") for e2e tests"
	fi
	echo "$out"
	rm -rf "$work"
}

# Import OCI archives into every node's containerd (namespace k8s.io, where
# the kubelet looks).
load_images() { # archive...
	local i a sock out
	for ((i = 0; i < NODES; i++)); do
		sock=$(node_dir_of "$i")/containerd.sock
		for a; do
			out=$("$CONTAINERD_BIN/ctr" --address "$sock" -n k8s.io images import "$a" 2>&1) || { echo "$out" >&2; false; } ||
				die "could not import $a into $(node_name_of "$i")'s containerd"
		done
	done
	log "imported $# image(s) into $NODES node(s): $(for a; do basename "$a" .oci.tar; done | paste -sd' ')"
}

# ---------------------------------------------------------------- per node

write_containerd_config() { # node-index
	local d
	d=$(node_dir_of "$1")
	mkdir -p "$d/containerd/root" "$d/containerd/state" "$d/cni/net.d" "$d/cni/cache" "$d/cni/ipam"
	cat >"$d/containerd.toml" <<EOF
# containerd of $(node_name_of "$1"), written by e2e/cluster up.
version = 4
root = '$d/containerd/root'
state = '$d/containerd/state'
# Nothing from /etc/containerd: the node is made only of what is here.
imports = []
# NRI's socket is one fixed path on the machine; two nodes would fight over it.
disabled_plugins = ['io.containerd.nri.v1.nri']

# containerd 2.4 configures its servers as plugins (version 4 config).
[plugins.'io.containerd.server.v1.grpc']
  address = '$d/containerd.sock'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = 'localhost/pause:$K8S_VERSION'
  # Per-registry settings (hosts.toml), read at each pull: \`e2e/cluster
  # registry\` adds its plain-HTTP registry there.
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = '$state/registry-hosts'

[plugins.'io.containerd.cri.v1.runtime']
  # Network namespaces under the node's own state dir, so that 'down' finds
  # and removes exactly this node's.
  netns_mounts_under_state_dir = true
  enable_unprivileged_ports = true
  # This machine may not lower a process's oom_score_adj below containerd's
  # own (seen: runc init 'failed to update /proc/self/oom_score_adj:
  # Permission denied' for the pause container's -998).
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = 'io.containerd.runc.v2'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = '$RUNC'
      SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['$CNI_BIN']
    conf_dir = '$d/cni/net.d'
    max_conf_num = 1
EOF
	# The node's pod network: a bridge of its own with its own subnet. No
	# masquerading: pods only talk to pods, Services and the API server, all
	# reachable through this machine's routing table.
	cat >"$d/cni/net.d/10-weir.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "weir-$(node_name_of "$1")",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$(node_bridge_of "$1")",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$d/cni/ipam",
        "ranges": [[{"subnet": "$(node_subnet_of "$1")"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

write_kubelet_config() { # node-index
	local d ip
	d=$(node_dir_of "$1")
	ip=$(node_ip_of "$1")
	mkdir -p "$d/kubelet" "$d/pod-logs"
	cat >"$d/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
port: 10250
readOnlyPort: 0
healthzBindAddress: $ip
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $state/pki/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$d/containerd.sock
# This machine has cgroup v1 (hybrid); Kubernetes 1.35+ refuses it unless told.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$(node_name_of "$1")
failSwapOn: false
clusterDNS: [$DNS_SERVICE_IP]
clusterDomain: $CLUSTER_DOMAIN
podLogsDir: $d/pod-logs
# Both nodes see the whole machine's disk: evict only when it is really full,
# and never garbage-collect the imported images (they cannot be pulled again).
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
maxPods: 60
rotateCertificates: false
EOF
}

node_cgroups_up() { # node-index
	local h name
	name=$(node_name_of "$1")
	for h in $(cgroup_hierarchies); do
		mkdir -p "$h/$name"
		# A new cpuset cgroup starts with no CPUs and no memory nodes; tasks
		# cannot join it until they are copied from the parent.
		if [[ -f $h/cpuset.cpus && -f $h/$name/cpuset.cpus && -z $(<"$h/$name/cpuset.cpus") ]]; then
			cat "$h/cpuset.cpus" >"$h/$name/cpuset.cpus"
			cat "$h/cpuset.mems" >"$h/$name/cpuset.mems"
		fi
	done
}

# Kill every process left in a node's cgroups (containers whose shim is gone)
# and remove the cgroups, deepest first.
node_cgroups_down() { # node-name
	local h name=$1 dir pids tries
	for h in $(cgroup_hierarchies); do
		[[ -d $h/$name ]] || continue
		for tries in 1 2 3 4 5 6 7 8 9 10; do
			pids=$(find "$h/$name" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u)
			[[ -n $pids ]] || break
			# shellcheck disable=SC2086
			kill -KILL $pids 2>/dev/null || true
			sleep 0.2
		done
		find "$h/$name" -depth -type d -exec rmdir {} \; 2>/dev/null || true
		[[ ! -d $h/$name ]] || log "warning: could not remove cgroup $h/$name"
	done
}

start_node() { # node-index
	local i=$1 d name ip
	d=$(node_dir_of "$i")
	name=$(node_name_of "$i")
	ip=$(node_ip_of "$i")
	write_containerd_config "$i"
	write_kubelet_config "$i"
	node_cgroups_up "$i"
	sign_cert ca "kubelet-$i" "/O=system:nodes/CN=system:node:$name" clientAuth
	write_kubeconfig "$d/kubelet.kubeconfig" "system:node:$name" "kubelet-$i"
	# The shim (containerd-shim-runc-v2) is found on PATH.
	PATH="$CONTAINERD_BIN:$PATH" start "containerd-$i" "$CONTAINERD_BIN/containerd" --config "$d/containerd.toml"
	wait_for "containerd of $name" "containerd-$i" test -S "$d/containerd.sock"
}

start_kubelet() { # node-index
	local i=$1 d name
	d=$(node_dir_of "$i")
	name=$(node_name_of "$i")
	start "kubelet-$i" "$K8S_BIN/kubelet" --config "$d/kubelet.yaml" --kubeconfig "$d/kubelet.kubeconfig" \
		--root-dir "$d/kubelet" --cert-dir "$d/kubelet/pki" --hostname-override "$name" --node-ip "$(node_ip_of "$i")"
	# The kubelet's device-plugin registration socket has a path compiled in
	# (/var/lib/kubelet/device-plugins/kubelet.sock), not under --root-dir,
	# so every kubelet on this host shares it. Each one empties the directory
	# and then binds: two starting at once can both empty it before either
	# binds, and the second bind fails with "address already in use" (the
	# kubelet exits). Starting the next kubelet only once this one listens
	# makes the order strict; the next one unlinks this socket (this kubelet
	# keeps serving on its open listener, and no device plugin runs here).
	wait_for "kubelet-$i to listen on the device-plugin socket" "kubelet-$i" \
		device_plugin_socket_bound "kubelet-$i"
}

# Compiled into the kubelet (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1),
# not under --root-dir.
KUBELET_SHARED_DIR=/var/lib/kubelet
DEVICE_PLUGIN_SOCKET=$KUBELET_SHARED_DIR/device-plugins/kubelet.sock

# After every kubelet of the cluster stopped: removes the shared directory
# if `up` created it and no other kubelet on this host uses it, and else
# at least the device-plugin socket when nothing listens on it any more.
kubelet_shared_dir_down() {
	if ss -xlpn 2>/dev/null | grep -qF "$DEVICE_PLUGIN_SOCKET"; then
		return 0
	fi
	if [[ -f $state/owns-kubelet-shared-dir ]] && ! pgrep -x kubelet >/dev/null; then
		rm -rf "$KUBELET_SHARED_DIR"
	else
		rm -f "$DEVICE_PLUGIN_SOCKET"
	fi
}

device_plugin_socket_bound() { # component
	local pid
	pid=$(running_pid "$1") || return 1
	ss -xlpn 2>/dev/null | grep -F "$DEVICE_PLUGIN_SOCKET" | grep -q "pid=$pid,"
}

node_ready() { # node-name
	[[ $(kubectl_admin get node "$1" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}') == True ]]
}

# Stop one node: kubelet first (so it restarts nothing), then every pod
# sandbox through the CRI (the CNI plugins remove veths and IP leases), then
# containerd, its shims and whatever still lives in the node's cgroups, then
# the node's mounts.
stop_node() { # node-index
	local i=$1 d name pid sock m
	d=$(node_dir_of "$i")
	name=$(node_name_of "$i")
	sock=$d/containerd.sock
	if pid=$(running_pid "kubelet-$i"); then stop_one "kubelet-$i" "$pid" component_runs "kubelet-$i"; fi
	if running_pid "containerd-$i" >/dev/null && [[ -S $sock ]]; then
		log "removing the pods of $name"
		timeout 60 "$CRICTL_BIN/crictl" --runtime-endpoint "unix://$sock" --timeout 20s rmp --all --force >/dev/null 2>&1 || true
	fi
	if pid=$(running_pid "containerd-$i"); then stop_one "containerd-$i" "$pid" component_runs "containerd-$i"; fi
	kill_matching "$d/"
	node_cgroups_down "$name"
	# Mounts under the node's directory (kubelet volumes, containerd's
	# snapshots and network namespaces), deepest first.
	for m in $(awk -v p="$d/" 'index($2, p) == 1 {print $2}' /proc/self/mounts | sort -r); do
		umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "warning: could not unmount $m"
	done
}

# Every process that makes up a running node: its kubelet and containerd,
# the shims (their command lines name the node's directory) and whatever
# runs in the node's cgroups (the containers). One pid per line, unsorted.
node_pids() { # node-index
	local i=$1 d name p args h
	d=$(node_dir_of "$i")
	name=$(node_name_of "$i")
	running_pid "kubelet-$i" || true
	running_pid "containerd-$i" || true
	for p in /proc/[0-9]*; do
		{ args=$(tr '\0' ' ' <"$p/cmdline"); } 2>/dev/null || continue
		[[ $args == *"$d/"* && ${p#/proc/} != "$$" ]] && echo "${p#/proc/}"
	done
	for h in $(cgroup_hierarchies); do
		[[ -d $h/$name ]] && find "$h/$name" -name cgroup.procs -exec cat {} + 2>/dev/null
	done
	return 0
}

# Sends SIGNAL to every process of a node at once: STOP freezes it (to the
# rest of the cluster it is a node cut off, or a paused VM), CONT thaws it.
node_signal() { # signal node-index
	local pids
	pids=$(node_pids "$2" | sort -un)
	[[ -n $pids ]] || die "node $(node_name_of "$2") has no processes"
	# shellcheck disable=SC2086
	kill "-$1" $pids 2>/dev/null || true
	log "sent SIG$1 to $(wc -w <<<"$pids") processes of $(node_name_of "$2")"
}

# SIGKILL every process whose command line names PREFIX (shims, strays).
kill_matching() { # prefix
	local p args
	for p in /proc/[0-9]*; do
		{ args=$(tr '\0' ' ' <"$p/cmdline"); } 2>/dev/null || continue
		[[ $args == *"$1"* && ${p#/proc/} != "$$" ]] || continue
		kill -KILL "${p#/proc/}" 2>/dev/null || true
	done
}

start_kube_proxy() {
	sign_cert ca kube-proxy "/CN=system:kube-proxy" clientAuth
	write_kubeconfig "$state/kube-proxy.kubeconfig" system:kube-proxy kube-proxy
	# KUBE_PROXY_PORT and KUBE_PROXY_METRICS_PORT come from cluster.env.
	cat >"$state/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $state/kube-proxy.kubeconfig}
mode: iptables
clusterCIDR: $POD_CIDR
hostnameOverride: $(node_name_of 0)
bindAddress: $HOST_IP
healthzBindAddress: 127.0.0.1:$KUBE_PROXY_PORT
metricsBindAddress: 127.0.0.1:$KUBE_PROXY_METRICS_PORT
# Leave the machine's conntrack table size alone.
conntrack: {maxPerCore: 0}
EOF
	start kube-proxy "$K8S_BIN/kube-proxy" --config "$state/kube-proxy.yaml"
}
kube_proxy_healthy() { curl -sf --max-time 3 "http://127.0.0.1:$KUBE_PROXY_PORT/healthz" >/dev/null; }

# ---------------------------------------------------------------- cluster DNS

start_coredns() {
	kubectl_admin apply --server-side --field-manager e2e-cluster -f - >/dev/null <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects: [{kind: ServiceAccount, name: coredns, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:53 {
        errors
        health :8080
        ready :8181
        kubernetes $CLUSTER_DOMAIN in-addr.arpa ip6.arpa {
            pods insecure
            ttl 30
        }
        cache 30
        loop
        reload
        loadbalance
    }
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: coredns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  replicas: 1
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata: {labels: {k8s-app: kube-dns}}
    spec:
      serviceAccountName: coredns
      priorityClassName: system-cluster-critical
      dnsPolicy: Default
      containers:
      - name: coredns
        image: localhost/coredns:$COREDNS_VERSION
        imagePullPolicy: Never
        args: [-conf, /etc/coredns/Corefile]
        ports:
        - {name: dns, containerPort: 53, protocol: UDP}
        - {name: dns-tcp, containerPort: 53, protocol: TCP}
        readinessProbe: {httpGet: {path: /ready, port: 8181}, periodSeconds: 2}
        livenessProbe: {httpGet: {path: /health, port: 8080}}
        resources: {requests: {cpu: 20m, memory: 40Mi}, limits: {memory: 170Mi}}
        securityContext:
          allowPrivilegeEscalation: false
          readOnlyRootFilesystem: true
          runAsNonRoot: true
          runAsUser: 65532
          capabilities: {drop: [ALL]}
          seccompProfile: {type: RuntimeDefault}
        volumeMounts: [{name: config, mountPath: /etc/coredns, readOnly: true}]
      volumes:
      - name: config
        configMap: {name: coredns}
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  selector: {k8s-app: kube-dns}
  clusterIP: $DNS_SERVICE_IP
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
EOF
}
coredns_available() {
	[[ $(kubectl_admin -n kube-system get deployment coredns -o 'jsonpath={.status.availableReplicas}') == 1 ]]
}
