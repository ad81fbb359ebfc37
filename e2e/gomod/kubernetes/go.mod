// Wrapper module for building the Kubernetes control plane binaries from the
// published k8s.io/kubernetes module. Not built in place: e2e/build-binaries
// copies it into the cache and adds, at the pinned version,
//   require k8s.io/kubernetes vX.Y.Z
//   replace k8s.io/<staging> => k8s.io/<staging> v0.Y.Z   (one per staging module)
// The replace list is generated from k8s.io/kubernetes's own go.mod (its
// "k8s.io/* v0.0.0" requirements / "./staging/src/..." replaces), because the
// set of staging modules changes between minor releases.
module weir.invalid/e2e/gomod/kubernetes

go 1.26.0
