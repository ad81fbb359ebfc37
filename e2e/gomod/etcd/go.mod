// Wrapper module for building etcd from go.etcd.io/etcd/server/v3, whose own
// go.mod has relative replace lines (so `go install ...@version` refuses it).
// Kept apart from the Kubernetes wrapper so their dependency versions don't
// fight. Not built in place: e2e/build-binaries copies it into the cache and
// adds `require go.etcd.io/etcd/server/v3 <pinned version>`.
module weir.invalid/e2e/gomod/etcd

go 1.26.0
