"""The default machine image of each cloud: NVIDIA drivers and CUDA, nothing of ours (the boot
script installs the replica runtime). `resources.image_id` overrides it per service."""

DEFAULT_IMAGES = {
    # An AMI name pattern, owner amazon; the newest match in the launch's region.
    "aws": "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)*",
    # An image family: its newest image.
    "gcp": "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accelerator-2204-amd64-with-nvidia-550",
    # publisher:offer:sku:version (Ubuntu 22.04 with NVIDIA's HPC stack).
    "azure": "microsoft-dsvm:ubuntu-hpc:2204:latest",
}
