//! Image name -> local binary. There is no container runtime: an image names a
//! binary built by this project (`weir`, `weir-controller` in `WEIR_BIN_DIR`),
//! or, for tests, one given in `WEIR_IMAGE_MAP=name=/path,...`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The images that map to the project's own binaries in `WEIR_BIN_DIR`.
pub const PROJECT_IMAGES: &[&str] = &["weir", "weir-controller"];

/// The bare name of an image: without registry, repository path, tag or
/// digest. `ghcr.io/acme/weir:1.2@sha256:..` -> `weir`.
pub fn image_name(image: &str) -> &str {
    let no_digest = image.split('@').next().unwrap_or(image);
    let last = no_digest.rsplit('/').next().unwrap_or(no_digest);
    last.split(':').next().unwrap_or(last)
}

#[derive(Debug, Clone, Default)]
pub struct ImageMap {
    bin_dir: Option<PathBuf>,
    extra: BTreeMap<String, PathBuf>,
}

impl ImageMap {
    /// `bin_dir` is `WEIR_BIN_DIR`; `map` is `WEIR_IMAGE_MAP`
    /// (`name=/path,name2=/path2`).
    pub fn new(bin_dir: Option<&str>, map: Option<&str>) -> Result<Self, String> {
        let mut extra = BTreeMap::new();
        for entry in map
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
        {
            let (name, path) = entry
                .split_once('=')
                .ok_or_else(|| format!("WEIR_IMAGE_MAP entry {entry:?} is not name=/path"))?;
            extra.insert(name.trim().to_string(), PathBuf::from(path.trim()));
        }
        Ok(Self {
            bin_dir: bin_dir.filter(|d| !d.is_empty()).map(PathBuf::from),
            extra,
        })
    }

    pub fn from_env() -> Result<Self, String> {
        Self::new(
            std::env::var("WEIR_BIN_DIR").ok().as_deref(),
            std::env::var("WEIR_IMAGE_MAP").ok().as_deref(),
        )
    }

    /// The binary an image stands for, or the reason it has none (the
    /// message goes to the pod's status, so it says what to do).
    pub fn resolve(&self, image: &str) -> Result<PathBuf, String> {
        let name = image_name(image);
        if let Some(p) = self.extra.get(name) {
            return Ok(p.clone());
        }
        if PROJECT_IMAGES.contains(&name) {
            return match &self.bin_dir {
                Some(dir) => Ok(dir.join(name)),
                None => Err(format!(
                    "image {image:?} maps to the binary {name:?}, but WEIR_BIN_DIR is not set on the node agent"
                )),
            };
        }
        let mut known: Vec<&str> = PROJECT_IMAGES.to_vec();
        known.extend(self.extra.keys().map(String::as_str));
        Err(format!(
            "image {image:?} (name {name:?}) is not available on this node: no container runtime; \
             known images: {} (add test images with WEIR_IMAGE_MAP=name=/path)",
            known.join(", ")
        ))
    }
}

/// The argv of a container: `command` replaces the image's entrypoint (the
/// mapped binary) and `args` follow. A `command[0]` whose file name is the
/// binary's own (`weir` for image `weir`) runs the mapped binary; any other
/// command runs as given (looked up in PATH).
pub fn container_argv(binary: &Path, command: &[String], args: &[String]) -> Vec<String> {
    let mut argv = Vec::new();
    match command.split_first() {
        None => argv.push(binary.display().to_string()),
        Some((first, rest)) => {
            let same = Path::new(first).file_name().is_some()
                && Path::new(first).file_name() == binary.file_name();
            argv.push(if same {
                binary.display().to_string()
            } else {
                first.clone()
            });
            argv.extend(rest.iter().cloned());
        }
    }
    argv.extend(args.iter().cloned());
    argv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_names() {
        assert_eq!(image_name("weir"), "weir");
        assert_eq!(image_name("weir:latest"), "weir");
        assert_eq!(
            image_name("ghcr.io/acme/weir-controller:0.1.0"),
            "weir-controller"
        );
        assert_eq!(image_name("localhost:5000/weir"), "weir");
        assert_eq!(
            image_name("docker.io/library/busybox@sha256:abc"),
            "busybox"
        );
        assert_eq!(image_name("reg:5000/a/b/weir:1@sha256:x"), "weir");
    }

    #[test]
    fn project_images_map_to_bin_dir() {
        let m = ImageMap::new(Some("/opt/bin"), None).unwrap();
        assert_eq!(
            m.resolve("weir:dev").unwrap(),
            PathBuf::from("/opt/bin/weir")
        );
        assert_eq!(
            m.resolve("example.com/weir-controller:1").unwrap(),
            PathBuf::from("/opt/bin/weir-controller")
        );
        let err = m.resolve("nginx:1.27").unwrap_err();
        assert!(
            err.contains("\"nginx\"") && err.contains("weir, weir-controller"),
            "{err}"
        );
    }

    #[test]
    fn no_bin_dir_is_a_clear_error() {
        let m = ImageMap::new(None, None).unwrap();
        assert!(m.resolve("weir").unwrap_err().contains("WEIR_BIN_DIR"));
    }

    #[test]
    fn test_map_overrides_and_extends() {
        let m = ImageMap::new(Some("/b"), Some("busybox=/bin/sleep, weir=/tmp/fake")).unwrap();
        assert_eq!(
            m.resolve("busybox:1.36").unwrap(),
            PathBuf::from("/bin/sleep")
        );
        assert_eq!(m.resolve("weir").unwrap(), PathBuf::from("/tmp/fake"));
        assert!(m.resolve("alpine").unwrap_err().contains("busybox"));
        assert!(ImageMap::new(None, Some("oops")).is_err());
    }

    #[test]
    fn argv_from_command_and_args() {
        let bin = Path::new("/b/weir");
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            container_argv(bin, &[], &s(&["--help"])),
            s(&["/b/weir", "--help"])
        );
        assert_eq!(
            container_argv(bin, &s(&["weir", "worker"]), &s(&["-v"])),
            s(&["/b/weir", "worker", "-v"])
        );
        assert_eq!(
            container_argv(bin, &s(&["/usr/local/bin/weir"]), &[]),
            s(&["/b/weir"])
        );
        assert_eq!(
            container_argv(bin, &s(&["sh", "-c", "x"]), &[]),
            s(&["sh", "-c", "x"])
        );
        let sleep = Path::new("/bin/sleep");
        assert_eq!(
            container_argv(sleep, &s(&["sleep", "3600"]), &[]),
            s(&["/bin/sleep", "3600"])
        );
    }
}
