# Building OCI images without a container daemon: a root filesystem put
# together from Debian's packages and files of ours, packed into layers with
# tar and assembled with umoci into an OCI image layout, written as an OCI
# archive (a tar of the layout) that `ctr images import`, skopeo, podman and
# crane all read. Sourced by scripts/build-images and e2e/cluster.
#
# Why this way: there is no Docker daemon or registry here, and an image is
# only a few tar files and JSON documents; umoci writes those documents
# (Debian's package) so we do not have to.

# Debian packages are cached by name under $WEIR_CACHE/debs (one download per
# machine; the version is whatever the configured archive serves and is
# recorded in the image's labels).
oci_debs_dir() { echo "${WEIR_CACHE:-$HOME/.cache/weir}/debs"; }

oci_need_tools() {
	local missing=() t
	for t in umoci dpkg-deb apt-get tar python3 objcopy; do command -v "$t" >/dev/null || missing+=("$t"); done
	if ((${#missing[@]})); then
		if [[ " ${missing[*]} " == *" umoci "* ]] && command -v apt-get >/dev/null; then
			echo "oci-image: installing umoci from Debian's packages" >&2
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq umoci >/dev/null 2>&1 ||
				{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq umoci >/dev/null; }
			missing=("${missing[@]/umoci/}")
		fi
		local m
		for m in "${missing[@]}"; do [[ -z $m ]] || { echo "oci-image: $m is missing" >&2; return 1; }; done
	fi
}

# Fetch .deb files of the given packages into the cache; prints their paths.
oci_fetch_debs() { # package...
	local dir pkg f
	dir=$(oci_debs_dir)
	mkdir -p "$dir"
	for pkg; do
		f=$(compgen -G "$dir/${pkg}_*.deb" | head -n1 || true)
		if [[ -z $f ]]; then
			(cd "$dir" && apt-get download "$pkg" >/dev/null 2>&1) ||
				(apt-get update -qq >/dev/null && cd "$dir" && apt-get download "$pkg" >/dev/null 2>&1) ||
				{ echo "oci-image: cannot download Debian package $pkg" >&2; return 1; }
			f=$(compgen -G "$dir/${pkg}_*.deb" | head -n1)
		fi
		echo "$f"
	done
}

# The version of a cached package (for labels).
oci_deb_version() { dpkg-deb -f "$1" Version; }

# A minimal base root filesystem into DIR: the C library, libgcc, OpenSSL's
# libraries (librdkafka's TLS and SASL/SCRAM), CA certificates and time zones from Debian's packages; no shell, no package
# manager. Users root (0) and nonroot (65532), a world-writable /tmp.
oci_base_rootfs() { # dir
	local dir=$1 deb
	mkdir -p "$dir"
	for deb in $(oci_fetch_debs libc6 libgcc-s1 libssl3 ca-certificates tzdata); do
		dpkg-deb -x "$deb" "$dir"
	done
	# Documentation, locales, character-set converters and the tools inside
	# the packages (ldconfig, tzselect, update-ca-certificates need a shell
	# or are pointless in an image).
	rm -rf "$dir"/usr/share/{doc,man,info,lintian,locale,bug} "$dir"/usr/lib/x86_64-linux-gnu/gconv \
		"$dir"/usr/sbin "$dir"/usr/bin "$dir"/sbin "$dir"/bin "$dir"/etc/ca-certificates* "$dir"/usr/libexec
	# What update-ca-certificates would generate: one bundle of the
	# Mozilla roots, where OpenSSL, rustls-native-certs and Go look.
	mkdir -p "$dir/etc/ssl/certs"
	cat "$dir"/usr/share/ca-certificates/mozilla/*.crt >"$dir/etc/ssl/certs/ca-certificates.crt"
	oci_users "$dir"
}

# /etc/passwd, /etc/group, /etc/nsswitch.conf and /tmp of an image.
oci_users() { # dir
	local dir=$1
	mkdir -p "$dir/etc" "$dir/tmp" "$dir/home/nonroot"
	chmod 1777 "$dir/tmp"
	chown 65532:65532 "$dir/home/nonroot"
	printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' 'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$dir/etc/passwd"
	printf '%s\n' 'root:x:0:' 'nonroot:x:65532:' >"$dir/etc/group"
	echo 'hosts: files dns' >"$dir/etc/nsswitch.conf"
}

# Copy a release binary into DIR/usr/local/bin, stripped. Debug information
# stays beside the image archive as NAME.debug (linked by build id): the
# symbol table, and the debug information when the release profile has any.
oci_add_binary() { # dir binary [debug-dir]
	local dir=$1 bin=$2 debug_dir=${3:-} name
	name=$(basename "$bin")
	mkdir -p "$dir/usr/local/bin"
	if [[ -n $debug_dir ]]; then
		mkdir -p "$debug_dir"
		objcopy --only-keep-debug "$bin" "$debug_dir/$name.debug"
	fi
	objcopy --strip-all "$bin" "$dir/usr/local/bin/$name"
	chmod 0755 "$dir/usr/local/bin/$name"
}

# A reproducible layer tarball of DIR's contents: sorted names, numeric
# owners as on disk, and a fixed modification time.
oci_layer() { # dir out.tar
	tar --sort=name --numeric-owner --mtime="@${SOURCE_DATE_EPOCH:-0}" --clamp-mtime \
		--format=posix --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
		-C "$1" -cf "$2" .
}

# Assemble an image from layer tarballs and write it as an OCI archive named
# NAME:TAG (the name containerd and podman show after an import).
#   oci_image out.tar NAME TAG layers="a.tar b.tar" -- umoci-config-args...
oci_image() { # out name tag layers -- config args...
	local out=$1 name=$2 tag=$3 layers=$4 work l
	shift 4
	[[ ${1:-} == -- ]] && shift
	work=$(mktemp -d)
	umoci init --layout "$work/layout"
	umoci new --image "$work/layout:$tag"
	for l in $layers; do
		umoci raw add-layer --image "$work/layout:$tag" --history.created_by "weir build: $(basename "$l")" "$l"
	done
	umoci config --image "$work/layout:$tag" --os linux --architecture amd64 \
		--created "$(date -u -d "@${SOURCE_DATE_EPOCH:-0}" +%Y-%m-%dT%H:%M:%SZ)" --no-history "$@"
	umoci gc --layout "$work/layout"
	# The full reference goes into the index, where containerd looks for
	# the name of an imported image (io.containerd.image.name) and other
	# tools for the tag (org.opencontainers.image.ref.name).
	python3 - "$work/layout/index.json" "$name:$tag" "$tag" <<'PY'
import json, sys
path, full, tag = sys.argv[1:]
index = json.load(open(path))
for m in index["manifests"]:
    ann = m.setdefault("annotations", {})
    if ann.get("org.opencontainers.image.ref.name") == tag:
        ann["io.containerd.image.name"] = full
json.dump(index, open(path, "w"))
PY
	mkdir -p "$(dirname "$out")"
	tar --sort=name --numeric-owner --mtime="@${SOURCE_DATE_EPOCH:-0}" -C "$work/layout" -cf "$out.tmp" .
	mv "$out.tmp" "$out"
	rm -rf "$work"
}
