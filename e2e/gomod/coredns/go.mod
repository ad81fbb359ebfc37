// Wrapper module for the cluster DNS of the test cluster: CoreDNS built with
// only the plugins a Kubernetes cluster DNS needs (the full plugin set pulls
// in every cloud SDK and triples the build). e2e/build-binaries copies it into
// the cache, adds `require github.com/coredns/coredns <pinned version>` and
// builds this package. The pattern is CoreDNS's own documented way to choose
// plugins at compile time: a main that imports coremain and the plugins.
module weir.invalid/e2e/gomod/coredns

go 1.26.0
