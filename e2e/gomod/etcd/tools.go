//go:build tools

// The binaries e2e/build-binaries builds from this module (the script reads
// this list). etcd's main package is the root of its server module.
package tools

import (
	_ "go.etcd.io/etcd/server/v3" // binary: etcd
)
