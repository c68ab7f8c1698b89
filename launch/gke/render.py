"""A GKE JobSet: the trainer and the index builder, each on its own TPU slice, one gs:// workdir.

  python launch/gke/render.py --config configs/realm_base.py \
      --workdir gs://my-bucket/realm/realm --set data.dir=gs://my-bucket/realm/data \
      --set retrieval.refresh=async --set init.retriever=gs://my-bucket/realm/ict \
      --set init.reader=gs://my-bucket/bert-base-uncased \
      --image us-docker.pkg.dev/my-project/realm/realm-jax:latest \
      --out launch/gke/realm_base.yaml
  kubectl apply -f launch/gke/realm_base.yaml

Two replicated Jobs, each Indexed with one pod per TPU host of its slice (--trainer_type,
default v4-32: 4 pods of 4 chips; --builder_type, default v4-8: 1 pod; `none`: no builder):
`trainer` runs `realm-train ... --multihost=auto` (JAX finds the other pods of its slice) and
`builder` runs `realm-index ...`, with the same config, overrides and workdir. --storage gcs
(default): the jobs use the gs:// paths themselves (the pods' service account needs access to
the buckets); --storage gcsfuse: every bucket the run names is mounted with the GCS FUSE CSI
driver at /gcs/BUCKET and gs:// paths become those paths. A pod that fails fails its Job (backoffLimit 0) and the JobSet restarts both Jobs (up
to --max_restarts): the trainer resumes from its last checkpoint. Pods get SIGTERM first and
--grace seconds before SIGKILL, at least the trainer's train.preemption_grace_seconds + 30
(the trainer saves a checkpoint: `processes.stop_grace`); the JobSet succeeds when the
trainer does. The image has the package installed with its [tpu] extra and configs/ in its
working directory (docs/launch.md, "GKE").
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys

import yaml

from realm_jax import log
from realm_jax.config.option_names import upgrade_flags
from realm_jax.errors import CommandParser, ConfigError, run_cli

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # launch/ holds scripts: import tpu_pod by name
from tpu_pod import (GRACE_SECONDS, MOUNT_ROOT, STORAGES, Plan, check_builder,  # noqa: E402
                     check_name, check_seconds, job_argv, job_slices, plan_run)

PROG = "render.py"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
GCSFUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
# 8471: the TPU runtime between hosts of a slice; 8482: JAX's coordinator on a TPU slice.
PORTS = (8471, 8482)


def pod_template(job: str, argv: list[str], tpu, args: argparse.Namespace,
                 plan: Plan) -> dict:
  """The pod of one host of `job`: its slice's node labels, all its chips, the buckets
  gcsfuse mounts (none with --storage gcs), and --grace s after SIGTERM (more where the
  trainer's save needs more: `plan.stop_grace`)."""
  buckets = plan.mounts
  spec = {
      "restartPolicy": "Never",
      "terminationGracePeriodSeconds": max(args.grace, math.ceil(plan.stop_grace)),
      "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": tpu.gke_accelerator,
                       "cloud.google.com/gke-tpu-topology": tpu.topology},
      "containers": [{
          "name": job,
          "image": args.image,
          "command": argv,     # exec form: SIGTERM reaches the job itself, not a shell
          "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
          "ports": [{"containerPort": p} for p in PORTS],
          "resources": {"limits": {"google.com/tpu": tpu.chips_per_host}},
      }],
  }
  if buckets:
    spec["containers"][0]["volumeMounts"] = [
        {"name": f"gcs-{i}", "mountPath": f"{MOUNT_ROOT}/{b}"} for i, b in enumerate(buckets)]
    spec["volumes"] = [{"name": f"gcs-{i}", "csi": {
        "driver": GCSFUSE_DRIVER,
        "volumeAttributes": {"bucketName": b, "mountOptions": "implicit-dirs"}}}
        for i, b in enumerate(buckets)]
  if args.service_account:
    spec = {"serviceAccountName": args.service_account, **spec}
  if not buckets:
    return {"spec": spec}
  return {"metadata": {"annotations": {"gke-gcsfuse/volumes": "true"}}, "spec": spec}


def jobset(args: argparse.Namespace, plan: Plan) -> dict:
  """The JobSet manifest as a dict (yaml.safe_dump writes it)."""
  replicated = []
  for job, tpu in job_slices(args).items():
    replicated.append({"name": job, "replicas": 1, "template": {"spec": {
        "parallelism": tpu.hosts,
        "completions": tpu.hosts,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": pod_template(job, job_argv(plan, job), tpu, args, plan)}}})
  return {
      "apiVersion": JOBSET_API,
      "kind": "JobSet",
      "metadata": {"name": args.name, "annotations": {
          # each Job gets a node pool (slice) of its own
          "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}},
      "spec": {
          "failurePolicy": {"maxRestarts": args.max_restarts},
          "successPolicy": {"operator": "All", "targetReplicatedJobs": ["trainer"]},
          "network": {"enableDNSHostnames": True},
          "replicatedJobs": replicated,
      },
  }


def command_line(args: argparse.Namespace, plan: Plan) -> str:
  """The render command that writes this manifest, run from the repository root (no --out)."""
  argv = ["--config", plan.config, "--workdir", args.workdir]
  for text in args.set:
    argv += ["--set", text]
  argv += ["--image", args.image, "--name", args.name, "--trainer_type", args.trainer_type,
           "--builder_type", args.builder_type, "--max_restarts", str(args.max_restarts),
           "--grace", str(args.grace)]
  argv += ["--service_account", args.service_account] if args.service_account else []
  argv += ["--storage", args.storage] if args.storage != "gcs" else []
  return "python launch/gke/render.py " + shlex.join(argv)


def render(args: argparse.Namespace) -> str:
  """Checks every flag, then the manifest's text: a header naming its command, the JobSet."""
  check_name(args.name, "--name", 40)
  check_seconds(args.grace, "--grace")
  if args.max_restarts < 0:
    raise ConfigError("", f"--max_restarts {args.max_restarts}: must be 0 or more")
  if not args.image:
    raise ConfigError("", "--image is required: the container image with realm_jax[tpu] and "
                      "configs/ in its working directory (docs/launch.md, GKE)")
  plan = plan_run(args.config, args.workdir, args.set, args.storage, job_slices(args))
  check_builder(plan, args.builder_type)
  body = yaml.safe_dump(jobset(args, plan), sort_keys=False, default_flow_style=False,
                        width=1000)
  return (f"# Rendered by launch/gke/render.py; do not edit: render again with\n"
          f"#   {command_line(args, plan)}\n{body}")


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = CommandParser(prog=PROG, description=__doc__.splitlines()[0],
                          allow_abbrev=False)
  parser.add_argument("--config", required=True, help="configs/X.py[:arg]")
  parser.add_argument("--workdir", required=True, help="gs://BUCKET/PATH shared by both jobs")
  parser.add_argument("--set", action="append", default=[], help="KEY=VALUE config override "
                      "for both jobs (repeat)")
  parser.add_argument("--storage", choices=STORAGES, default="gcs", help="gcs: the jobs read "
                      "and write gs:// paths themselves; gcsfuse: mount every bucket at "
                      "/gcs/BUCKET (GCS FUSE CSI driver) and pass those paths")
  parser.add_argument("--image", default="", help="container image (realm_jax[tpu], configs/)")
  parser.add_argument("--name", default="realm", help="the JobSet's name")
  parser.add_argument("--trainer_type", default="v4-32", help="the trainer's TPU slice")
  parser.add_argument("--builder_type", default="v4-8",
                      help="the index builder's TPU slice; none: no builder")
  parser.add_argument("--service_account", default="",
                      help="Kubernetes service account with access to the buckets")
  parser.add_argument("--max_restarts", type=int, default=3,
                      help="JobSet restarts after a failed pod (the trainer resumes)")
  parser.add_argument("--grace", type=int, default=GRACE_SECONDS,
                      help="seconds between SIGTERM and SIGKILL (at least the trainer's "
                      "train.preemption_grace_seconds + 30)")
  parser.add_argument("--out", default="", help="write here (default: stdout)")
  log.add_verbosity_argument(parser)
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  """`python launch/gke/render.py --config C --workdir gs://B/P --image I [--out F]`."""
  args = parse_args(upgrade_flags(sys.argv[1:] if argv is None else argv, PROG))
  log.set_verbosity(args.verbosity)
  text = run_cli(PROG, lambda: render(args))
  if args.out:
    run_cli(PROG, lambda: write(args.out, text))
    print(f"{PROG}: wrote {args.out}", file=sys.stderr)
  else:
    sys.stdout.write(text)
  return 0


def write(path: str, text: str) -> None:
  """The manifest to --out; a path that cannot be written is a bad flag (one line)."""
  try:
    with open(path, "w") as f:
      f.write(text)
  except OSError as e:
    raise ConfigError("", f"--out {path!r}: {e.strerror or e}") from None


if __name__ == "__main__":
  sys.exit(main())
