#!/usr/bin/env python3
"""Checks of a `helm template` render of charts/weir-operator, standard library only.

    charts/check-rendered.py RENDERED.yaml [--watch-namespace NS]

- the operator Deployment's pod and containers have the restricted security
  context (runAsNonRoot, runAsUser 65532, readOnlyRootFilesystem,
  allowPrivilegeEscalation false, capabilities drop ALL, seccomp RuntimeDefault);
- no RBAC rule uses "*" (apiGroups, resources, verbs, resourceNames);
- Secrets: no rule lets the operator list, watch, patch, update or delete
  any, and it may get only the control key Secret its Deployment names
  (--control-key-secret), by name, in its own namespace;
- nothing is bound to the worker ServiceAccount and it mounts no token;
- the operator gets a default worker image and the workers' UID, and its
  metrics address is the pod IP alone (an IPv6 pod IP takes no ":port");
- a PodDisruptionBudget exactly when there is more than one replica, selecting
  the operator's pods;
- networkpolicies in RBAC exactly when the operator makes NetworkPolicies
  (--worker-network-policy), with --operator-pod-labels matching its pods;
- with --watch-namespace: no cluster-scoped RBAC object, and the job Role is in NS.

Silent when all is well; otherwise prints one line per problem and exits 1. The parser reads
the block YAML that helm renders (mappings, sequences, quoted and plain
scalars, flow `[...]`/`{...}` in JSON form); anything else is an error, not a
guess.
"""
import json
import re
import sys


class Unsupported(Exception):
    pass


def strip_comment(t):
    """Drop a trailing ` # comment` outside quotes."""
    if t[:1] in "\"'":
        q, j = t[0], 1
        while j < len(t):
            if t[j] == "\\" and q == '"':
                j += 2
                continue
            if t[j] == q:
                if q == "'" and t[j + 1 : j + 2] == "'":
                    j += 2
                    continue
                return t[: j + 1] + re.sub(r"^\s+#.*$", "", t[j + 1 :])
            j += 1
        return t
    m = re.search(r"\s#", t)
    return t[: m.start()] if m else t


def scalar(text, where):
    t = strip_comment(text.strip()).strip()
    if t == "" or t in ("null", "~"):
        return None
    if t[0] in "[{":
        try:
            return json.loads(t)
        except ValueError:
            raise Unsupported(f"{where}: flow collection that is not JSON: {t}")
    if t[0] == '"':
        return json.loads(t)
    if t[0] == "'":
        if not t.endswith("'"):
            raise Unsupported(f"{where}: unterminated quote: {t}")
        return t[1:-1].replace("''", "'")
    if t[0] in "|>&*!":
        raise Unsupported(f"{where}: block scalar, anchor or tag: {t}")
    if t in ("true", "false"):
        return t == "true"
    if re.fullmatch(r"[-+]?[0-9]+", t):
        return int(t)
    return t


# A plain key (no quote or flow opener first, no ": " inside) then ":".
MAP_ENTRY = re.compile(r"([^\s\"'\[{#][^:]*?):(\s|$)")
QUOTED_KEY = re.compile(r"""("(?:[^"\\]|\\.)*"|'(?:[^']|'')*')\s*:(\s|$)""")


def is_map_entry(content):
    return bool(MAP_ENTRY.match(content) or QUOTED_KEY.match(content))


def split_key(content, where):
    """`key: value` or `key:` -> (key, value text); keys may be quoted."""
    q = QUOTED_KEY.match(content)
    if q:
        return scalar(q.group(1), where), content[q.end(1) :].lstrip()[1:]
    m = MAP_ENTRY.match(content)
    if not m:
        raise Unsupported(f"{where}: not a mapping entry: {content}")
    return m.group(1), content[m.end(1) + 1 :]


def parse_block(lines, i, indent):
    """Parse the node whose lines start at lines[i] with exactly `indent`."""
    _, ind, content = lines[i]
    if content == "-" or content.startswith("- "):
        return parse_seq(lines, i, indent)
    return parse_map(lines, i, indent)


def parse_seq(lines, i, indent):
    out = []
    while i < len(lines):
        no, ind, content = lines[i]
        if ind < indent or not (content == "-" or content.startswith("- ")):
            break
        if ind > indent:
            raise Unsupported(f"line {no}: bad indentation")
        rest = content[1:].lstrip()
        if rest == "":
            i += 1
            if i < len(lines) and lines[i][1] > indent:
                v, i = parse_block(lines, i, lines[i][1])
            else:
                v = None
        else:
            # "- key: v" opens a mapping whose entries are indented to "key".
            inner = indent + (len(content) - len(rest))
            if rest.startswith("- ") or is_map_entry(rest):
                lines[i] = (no, inner, rest)
                v, i = parse_block(lines, i, inner)
            else:
                v, i = scalar(rest, f"line {no}"), i + 1
        out.append(v)
    return out, i


def parse_map(lines, i, indent):
    out = {}
    while i < len(lines):
        no, ind, content = lines[i]
        if ind < indent:
            break
        if ind > indent:
            raise Unsupported(f"line {no}: bad indentation")
        if content == "-" or content.startswith("- "):
            break
        key, rest = split_key(content, f"line {no}")
        if key in out:
            raise Unsupported(f"line {no}: duplicate key {key!r}")
        i += 1
        if rest.strip() == "":
            if i < len(lines) and lines[i][1] > indent:
                out[key], i = parse_block(lines, i, lines[i][1])
            elif i < len(lines) and lines[i][1] == indent and lines[i][2].startswith("- "):
                out[key], i = parse_seq(lines, i, indent)
            else:
                out[key] = None
        else:
            out[key] = scalar(rest, f"line {no}")
    return out, i


def parse_documents(text):
    docs, current = [], []
    for no, raw in enumerate(text.splitlines(), 1):
        if raw.rstrip() == "---":
            docs.append(current)
            current = []
            continue
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise Unsupported(f"line {no}: tab indentation")
        current.append((no, len(raw) - len(raw.lstrip(" ")), raw.strip()))
    docs.append(current)
    out = []
    for lines in docs:
        if not lines:
            continue
        doc, end = parse_block(lines, 0, lines[0][1])
        if end != len(lines):
            raise Unsupported(f"line {lines[end][0]}: unexpected content")
        out.append(doc)
    return out


def get(obj, *path):
    for p in path:
        if not isinstance(obj, dict) or p not in obj:
            return None
        obj = obj[p]
    return obj


def main(argv):
    args = argv[1:]
    watch = None
    if len(args) == 3 and args[1] == "--watch-namespace":
        watch = args[2]
    elif len(args) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    path = args[0]
    try:
        docs = parse_documents(open(path).read())
    except Unsupported as e:
        print(f"{path}: cannot parse: {e}")
        return 1
    problems = []
    for d in docs:
        if not (isinstance(d, dict) and d.get("apiVersion") and d.get("kind") and get(d, "metadata", "name")):
            problems.append(f"an object without apiVersion, kind or metadata.name: {d!r:.200}")
    named = lambda d: f"{d.get('kind')}/{get(d, 'metadata', 'name')}"

    deployments = [d for d in docs if d.get("kind") == "Deployment"]
    if len(deployments) != 1:
        problems.append(f"expected one Deployment, found {len(deployments)}")
    for dep in deployments:
        pod = get(dep, "spec", "template", "spec") or {}
        psc = pod.get("securityContext") or {}
        want_pod = {"runAsNonRoot": True, "runAsUser": 65532}
        for k, v in want_pod.items():
            if psc.get(k) != v:
                problems.append(f"{named(dep)}: pod securityContext.{k} is {psc.get(k)!r}, want {v!r}")
        if get(psc, "seccompProfile", "type") != "RuntimeDefault":
            problems.append(f"{named(dep)}: pod securityContext.seccompProfile.type is not RuntimeDefault")
        if pod.get("automountServiceAccountToken") is not True:
            problems.append(f"{named(dep)}: automountServiceAccountToken is not true")
        containers = (pod.get("containers") or []) + (pod.get("initContainers") or [])
        if not containers:
            problems.append(f"{named(dep)}: no containers")
        for c in containers:
            sc = c.get("securityContext") or {}
            want = {
                "runAsNonRoot": True,
                "runAsUser": 65532,
                "readOnlyRootFilesystem": True,
                "allowPrivilegeEscalation": False,
            }
            for k, v in want.items():
                if sc.get(k) != v:
                    problems.append(f"{named(dep)} container {c.get('name')}: securityContext.{k} is {sc.get(k)!r}, want {v!r}")
            if get(sc, "capabilities", "drop") != ["ALL"]:
                problems.append(f"{named(dep)} container {c.get('name')}: capabilities.drop is {get(sc, 'capabilities', 'drop')!r}, want ['ALL']")
            if get(sc, "capabilities", "add"):
                problems.append(f"{named(dep)} container {c.get('name')}: capabilities.add is set")
            if sc.get("privileged"):
                problems.append(f"{named(dep)} container {c.get('name')}: privileged")
            if get(sc, "seccompProfile", "type") != "RuntimeDefault":
                problems.append(f"{named(dep)} container {c.get('name')}: seccompProfile.type is not RuntimeDefault")

    for dep in deployments:
        pod = get(dep, "spec", "template", "spec") or {}
        args = [a for c in pod.get("containers") or [] for a in c.get("args") or []]
        for prefix in ("--default-worker-image=", "--worker-uid="):
            if not any(str(a).startswith(prefix) and len(str(a)) > len(prefix) for a in args):
                problems.append(f"{named(dep)}: no {prefix}... argument")
        if "--metrics-addr=$(POD_IP)" not in args:
            problems.append(f"{named(dep)}: --metrics-addr is not the pod IP alone: {args}")
        # The workers' CA: a file of a ConfigMap volume, mounted where the argument says.
        ca = next((str(a).split("=", 1)[1] for a in args if str(a).startswith("--worker-ca-file=")), None)
        if ca is not None:
            mounts = [m for c in pod.get("containers") or [] for m in c.get("volumeMounts") or []]
            mount = next((m for m in mounts if ca.startswith(m.get("mountPath", "").rstrip("/") + "/")), None)
            volume = mount and next((v for v in pod.get("volumes") or [] if v.get("name") == mount.get("name")), None)
            if not volume or "configMap" not in volume:
                problems.append(f"{named(dep)}: --worker-ca-file={ca} is not in a mounted ConfigMap volume")
            elif not mount.get("readOnly"):
                problems.append(f"{named(dep)}: the worker CA's mount is not read-only")
        selector = get(dep, "spec", "selector", "matchLabels") or {}
        replicas = get(dep, "spec", "replicas") or 1
        pdbs = [d for d in docs if d.get("kind") == "PodDisruptionBudget"]
        if replicas > 1 and not any(get(p, "spec", "selector", "matchLabels") == selector for p in pdbs):
            problems.append(f"{named(dep)}: {replicas} replicas and no PodDisruptionBudget selecting them")
        if replicas == 1 and pdbs:
            problems.append(f"{named(dep)}: one replica, yet a PodDisruptionBudget (it would block every drain)")
        policy = "--worker-network-policy" in args
        rbac_np = any("networkpolicies" in (rule.get("resources") or []) for d in docs if d.get("kind") in ("Role", "ClusterRole") for rule in d.get("rules") or [])
        if policy != rbac_np:
            problems.append(f"{named(dep)}: --worker-network-policy is {policy}, but networkpolicies in RBAC is {rbac_np}")
        if policy:
            labels = next((str(a).split("=", 1)[1] for a in args if str(a).startswith("--operator-pod-labels=")), "")
            pairs = dict(p.split("=", 1) for p in labels.split(",") if "=" in p)
            pod_labels = get(dep, "spec", "template", "metadata", "labels") or {}
            if not pairs or any(pod_labels.get(k) != v for k, v in pairs.items()):
                problems.append(f"{named(dep)}: --operator-pod-labels={labels} does not select the operator's pods {pod_labels}")

    # The control key Secret the operator reads: named in its arguments, in its namespace.
    key_secret, own_ns = None, None
    for dep in deployments:
        dep_args = [str(a) for c in get(dep, "spec", "template", "spec", "containers") or [] for a in c.get("args") or []]
        key_secret = next((a.split("=", 1)[1] for a in dep_args if a.startswith("--control-key-secret=")), None)
        own_ns = get(dep, "metadata", "namespace")
        if not key_secret:
            problems.append(f"{named(dep)}: no --control-key-secret")

    roles = [d for d in docs if d.get("kind") in ("Role", "ClusterRole")]
    if not roles:
        problems.append("no Role or ClusterRole rendered")
    for r in roles:
        for n, rule in enumerate(r.get("rules") or []):
            for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                for v in rule.get(field) or []:
                    if "*" in str(v):
                        problems.append(f"{named(r)} rule {n}: {field} contains {v!r}")
        if r.get("aggregationRule"):
            problems.append(f"{named(r)}: aggregationRule")
        for n, rule in enumerate(r.get("rules") or []):
            if "secrets" not in (rule.get("resources") or []):
                continue
            verbs = set(rule.get("verbs") or [])
            names = rule.get("resourceNames") or []
            if verbs - {"create", "get"}:
                problems.append(f"{named(r)} rule {n}: verbs {sorted(verbs - {'create', 'get'})} on secrets (only create, and get of the control key)")
            if "get" in verbs and (r.get("kind") != "Role" or names != [key_secret] or get(r, "metadata", "namespace") != own_ns):
                problems.append(f"{named(r)} rule {n}: get on secrets other than the control key {own_ns}/{key_secret}")

    workers = [d for d in docs if d.get("kind") == "ServiceAccount" and d.get("automountServiceAccountToken") is False]
    if len(workers) != 1:
        problems.append(f"expected one ServiceAccount with automountServiceAccountToken: false (the worker's), found {len(workers)}")
    for w in workers:
        wname, wns = get(w, "metadata", "name"), get(w, "metadata", "namespace")
        for b in docs:
            if b.get("kind") in ("RoleBinding", "ClusterRoleBinding"):
                for s in b.get("subjects") or []:
                    if s.get("kind") == "ServiceAccount" and s.get("name") == wname and s.get("namespace") == wns:
                        problems.append(f"{named(b)} binds the worker ServiceAccount {wns}/{wname}")
        if watch and wns != watch:
            problems.append(f"worker ServiceAccount is in {wns!r}, want the watched namespace {watch!r}")

    if watch:
        for d in docs:
            if d.get("kind") in ("ClusterRole", "ClusterRoleBinding"):
                problems.append(f"{named(d)}: cluster-scoped RBAC although watchNamespace is {watch}")
        if not any(r.get("kind") == "Role" and get(r, "metadata", "namespace") == watch for r in roles):
            problems.append(f"no Role in the watched namespace {watch}")

    for p in problems:
        print(f"{path}: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
