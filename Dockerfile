# weir's two images, for users with Docker, Podman or Buildah:
#
#   docker build --target weir            --build-arg REVISION=$(git rev-parse HEAD) -t <registry>/weir:0.1.0 .
#   docker build --target weir-controller --build-arg REVISION=$(git rev-parse HEAD) -t <registry>/weir-controller:0.1.0 .
#
# The same images as scripts/build-images (which builds them without a
# container daemon, as the project's own tests do): the stripped release
# binary on a base with only glibc, libgcc, OpenSSL, CA certificates and time zones
# (distroless cc, Debian 12, like scripts/build-images' base from Debian's
# packages), no shell, no package manager, numeric non-root user 65532.
# See the README, "Container images", for pushing them and pointing the chart
# and StreamJobs at them.

# The crate version (scripts/build-images refuses to build when this default
# and the workspace's version differ, so the two kinds of image agree).
ARG VERSION=0.1.0
ARG REVISION=unknown

FROM docker.io/library/rust:1.94-bookworm AS build
WORKDIR /src
COPY . .
# --workspace: the feature set the project builds and tests with.
RUN cargo build --release --locked --workspace --bin weir --bin weir-controller \
 && mkdir /out \
 && objcopy --strip-all target/release/weir /out/weir \
 && objcopy --strip-all target/release/weir-controller /out/weir-controller

# What both images share: the base, the user, the working directory, the
# labels that do not depend on the binary.
FROM gcr.io/distroless/cc-debian12:nonroot AS base
ARG VERSION
ARG REVISION
USER 65532:65532
WORKDIR /home/nonroot
LABEL org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/weir-dev/weir" \
      org.opencontainers.image.base.name="gcr.io/distroless/cc-debian12:nonroot"

FROM base AS weir
COPY --from=build /out/weir /usr/local/bin/weir
ENTRYPOINT ["/usr/local/bin/weir"]
LABEL org.opencontainers.image.title="weir runtime" \
      org.opencontainers.image.description="The weir streaming runtime: runs a StreamJob's workers (weir worker) or a whole job locally (weir run)."

FROM base AS weir-controller
COPY --from=build /out/weir-controller /usr/local/bin/weir-controller
ENTRYPOINT ["/usr/local/bin/weir-controller"]
LABEL org.opencontainers.image.title="weir operator" \
      org.opencontainers.image.description="The weir Kubernetes operator: reconciles StreamJobs into worker pods, savepoints before upgrades, restores after failures."
