#!/usr/bin/env bash
# Smoke test of the node agent against a real local control plane:
# Node Ready, a pod that exits (Succeeded), a long-running pod (Running,
# podIP, service-account token and configMap/secret/emptyDir volumes at
# their paths, env from fieldRef/secretKeyRef/configMapKeyRef), a pod with
# an unknown image (Failed, ErrImagePull), deletion.
#
#   e2e/node-agent/smoke.sh            # builds the agent (dev profile) first
#   WEIR_NODE_AGENT=path/to/weir-node-agent e2e/node-agent/smoke.sh   # uses that build
#
# Uses its own WEIR_CLUSTER_DIR and takes the cluster down at the end.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
e2e=$(dirname "$here")
if [[ -n ${WEIR_NODE_AGENT:-} ]]; then
	agent=$WEIR_NODE_AGENT
else
	export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/weir/target-agent}
	cargo build -q -p weir-node-agent --manifest-path "$here/Cargo.toml"
	agent=$CARGO_TARGET_DIR/debug/weir-node-agent
fi

export WEIR_CLUSTER_DIR=${WEIR_CLUSTER_DIR:-$(mktemp -d /tmp/weir-agent-smoke.XXXXXX)/c}
# The `weir` image: a stand-in script, so the test needs no release build of
# the runtime (WEIR_BIN_DIR is what the real setup points at the build).
bins=$(dirname "$WEIR_CLUSTER_DIR")/bin
mkdir -p "$bins"
printf '#!/bin/sh\necho "weir stand-in: $*"\nexit 0\n' >"$bins/weir"
chmod +x "$bins/weir"
export WEIR_BIN_DIR=$bins WEIR_IMAGE_MAP=busybox=/bin/sleep,shell=/bin/sh
# Mount points that exist before the run are not the agent's to remove.
pre_existing=""
for d in /etc/cfg /etc/sec /scratch; do [[ ! -e $d ]] || pre_existing+=" $d"; done
trap '"$e2e/cluster" down >/dev/null 2>&1 || true' EXIT
eval "$(WEIR_NODE_AGENT=$agent "$e2e/cluster" up)"
PATH="$("$e2e/build-binaries" | paste -sd:):$PATH"

fail() { echo "FAIL: $*" >&2; kubectl get pods -o wide >&2 || true; tail -n 30 "$WEIR_CLUSTER_DIR/logs/node-agent.log" >&2; exit 1; }
wait_for() { # seconds description command...
	local n=$1 what=$2
	shift 2
	for ((i = 0; i < n * 2; i++)); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 0.5
	done
	fail "timed out waiting for $what"
}
phase() { [[ $(kubectl get pod "$1" -o jsonpath='{.status.phase}') == "$2" ]]; }
passed=0
ok() { echo "ok: $*"; passed=$((passed + 1)); }

kubectl get nodes
[[ $(kubectl get node weir-node -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}') == True ]] || fail "node not Ready"
ok "node Ready"
wait_for 60 "not-ready taint removed" bash -c '[[ -z $(kubectl get node weir-node -o jsonpath="{.spec.taints}") ]]'
ok "no taints"
kubectl get lease -n kube-node-lease weir-node >/dev/null || fail "no lease"
ok "lease"

kubectl create configmap cfg --from-literal=greeting=hello
kubectl create secret generic sec --from-literal=password=hunter2
kubectl apply -f - <<'EOF'
apiVersion: v1
kind: Pod
metadata: {name: once}
spec:
  restartPolicy: Never
  containers: [{name: main, image: weir:dev, args: ["--help"]}]
---
apiVersion: v1
kind: Pod
metadata: {name: long, labels: {app: long}}
spec:
  terminationGracePeriodSeconds: 3
  containers:
  - name: main
    image: shell
    command: ["sh", "-c"]
    args:
    - |
      echo "ip=$POD_IP name=$MY_NAME ns=$MY_NS node=$MY_NODE secret=$PW greeting=$GREETING host=$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"
      ls /var/run/secrets/kubernetes.io/serviceaccount
      cat /etc/cfg/greeting /etc/sec/password; echo
      echo scratch > /scratch/f && cat /scratch/f
      echo "hostname=$(hostname)"; grep -w long /etc/hosts
      sleep 3; touch /scratch/ready
      curl -s --cacert /var/run/secrets/kubernetes.io/serviceaccount/ca.crt \
        -H "Authorization: Bearer $(cat /var/run/secrets/kubernetes.io/serviceaccount/token)" \
        "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/api/v1/namespaces/$(cat /var/run/secrets/kubernetes.io/serviceaccount/namespace)/pods/$MY_NAME" | head -c 300; echo
      trap 'echo got SIGTERM; exit 0' TERM
      while :; do sleep 1; done
    env:
    - {name: MY_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
    - {name: MY_NS, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
    - {name: MY_NODE, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
    - {name: PW, valueFrom: {secretKeyRef: {name: sec, key: password}}}
    - {name: GREETING, valueFrom: {configMapKeyRef: {name: cfg, key: greeting}}}
    readinessProbe:
      exec: {command: [test, -f, /scratch/ready]}
      periodSeconds: 1
    volumeMounts:
    - {name: cfg, mountPath: /etc/cfg}
    - {name: sec, mountPath: /etc/sec, readOnly: true}
    - {name: scratch, mountPath: /scratch}
  volumes:
  - {name: cfg, configMap: {name: cfg}}
  - {name: sec, secret: {secretName: sec}}
  - {name: scratch, emptyDir: {}}
---
apiVersion: v1
kind: Pod
metadata: {name: badimage}
spec:
  containers: [{name: main, image: nginx:1.27}]
---
apiVersion: v1
kind: Pod
metadata: {name: crash}
spec:
  restartPolicy: OnFailure
  containers: [{name: main, image: shell, command: ["sh", "-c", "exit 3"]}]
---
apiVersion: v1
kind: Pod
metadata: {name: unlive}
spec:
  containers:
  - name: main
    image: busybox
    command: [sleep, "3600"]
    livenessProbe: {tcpSocket: {port: 1}, periodSeconds: 1, failureThreshold: 2}
EOF

wait_for 60 "pod once Succeeded" phase once Succeeded
ok "once Succeeded (exit $(kubectl get pod once -o jsonpath='{.status.containerStatuses[0].state.terminated.exitCode}'))"
wait_for 60 "pod long Running" phase long Running
[[ $(kubectl get pod long -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}') == False ]] || fail "long Ready before its readiness probe passed"
ok "long Running, not Ready before its readiness probe passes"
wait_for 30 "pod long Ready" bash -c '[[ $(kubectl get pod long -o jsonpath="{.status.conditions[?(@.type==\"Ready\")].status}") == True ]]'
ip=$(kubectl get pod long -o jsonpath='{.status.podIP}')
[[ $ip == 127.0.* && $ip != 127.0.0.1 ]] || fail "podIP $ip"
ok "long Running and Ready, podIP $ip"
kubectl get pods -o wide
wait_for 60 "pod badimage Failed" phase badimage Failed
kubectl get pod badimage -o jsonpath='{.status.reason}: {.status.message}{"\n"}'
ok "badimage Failed"
wait_for 30 "crash restarts" bash -c '(( $(kubectl get pod crash -o jsonpath="{.status.containerStatuses[0].restartCount}") >= 2 ))'
ok "crash restarted $(kubectl get pod crash -o jsonpath='{.status.containerStatuses[0].restartCount}') times"
wait_for 30 "unlive restarted by its liveness probe" bash -c '(( $(kubectl get pod unlive -o jsonpath="{.status.containerStatuses[0].restartCount}") >= 1 ))'
ok "liveness probe failure restarts the container"

log=$(ls "$WEIR_CLUSTER_DIR"/pods/default_long_*/logs/main.log)
# RBAC forbids default:default to get pods, but the 403 names the
# authenticated user: the token was accepted.
wait_for 10 "long's API call" grep -q 'system:serviceaccount:default:default' "$log"
cat "$log"
grep -q "ip=$ip name=long ns=default node=weir-node secret=hunter2 greeting=hello" "$log" || fail "env"
grep -qx token "$log" && grep -qx ca.crt "$log" && grep -qx namespace "$log" || fail "service-account files"
grep -qx hellohunter2 "$log" || fail "configMap/secret volumes"
grep -qx scratch "$log" || fail "emptyDir"
grep -qx hostname=long "$log" || fail "hostname"
grep -qP "^$ip\tlong$" "$log" || fail "/etc/hosts"
ok "env, volumes, service-account token accepted by the API server"
[[ ! -e /etc/cfg/greeting ]] || fail "the configMap volume leaked into the host's mount namespace"
ok "mounts private to the pod"

kubectl delete pod long --wait=true --timeout=30s
grep -q "got SIGTERM" "$log" || fail "no SIGTERM seen"
ok "long deleted after SIGTERM"
kubectl delete pod once badimage crash unlive --wait=true --timeout=30s
[[ -z $(kubectl get pods -o name) ]] || fail "pods left"
ok "all pods gone"
"$e2e/cluster" down
for d in /etc/cfg /etc/sec /scratch; do
	[[ " ${pre_existing:-} " == *" $d "* || ! -e $d ]] || fail "mount point $d left on the host after down"
done
ok "mount points the agent created are gone after down"
echo "$passed passed, 0 failed"
