"""An AWS that boots its VMs: moto's EC2 server, plus a machine (tests/fakes/vm_runner) for
every instance that runs, started from the instance's own user-data, with an IMDSv2 server of
its own (tests/fakes/metadata). Nothing of the product is changed: the daemon talks to it with
boto3 through AWS_ENDPOINT_URL, exactly as to AWS.

What the emulator adds to moto, as the cloud would have it: a default VPC whose subnets are
loopback ranges (127.20.N.0/24: a VM's private address is reachable from this host), the Deep
Learning AMI in the public image catalog, and spot interruptions: the warning at the instance's
IMDS, then its termination at the deadline (`preempt`).
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time

import boto3
from moto.backends import get_backend
from moto.core import DEFAULT_ACCOUNT_ID
from moto.server import ThreadedMotoServer

from providers.images import DEFAULT_IMAGES
from tests.fakes.clouds import serve
from tests.fakes.metadata import AWSInstanceMetadata
from tests.fakes.vm_runner import VMRunner
from tests.helpers import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class EmulatedAWS:
    def __init__(self, runner: VMRunner, region: str = "us-east-1", poll_s: float = 0.5):
        self.runner, self.region, self.poll_s = runner, region, poll_s
        self.url = ""
        self.metadata: dict[str, AWSInstanceMetadata] = {}
        self.preempted: list[str] = []
        self._servers = contextlib.ExitStack()
        self._server_urls: dict[str, contextlib.ExitStack] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._moto: ThreadedMotoServer | None = None

    # ---- life ----------------------------------------------------------------------------

    def start(self) -> EmulatedAWS:
        port = free_port()
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._moto.start()
        self.url = f"http://127.0.0.1:{port}"
        self._loopback_default_vpc()
        self._publish_gpu_image()
        self._thread = threading.Thread(target=self._run, name="emulated-aws", daemon=True)
        self._thread.start()
        return self

    def env(self) -> dict[str, str]:
        """What a daemon (or spotctl) process needs to use this AWS: boto3's own settings."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.url, "AWS_DEFAULT_REGION": self.region,
                "AWS_EC2_METADATA_DISABLED": "true", "SPOT_ORCHESTRATOR_REPLICA_ADDRESS": "private"}

    def client(self):
        return boto3.client("ec2", region_name=self.region, endpoint_url=self.url, **{
            "aws_access_key_id": "testing", "aws_secret_access_key": "testing"})

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.runner.close()
        for stack in self._server_urls.values():
            stack.close()
        if self._moto is not None:
            self._moto.stop()

    # ---- the cloud's side ------------------------------------------------------------------

    def _backend(self):
        return get_backend("ec2")[DEFAULT_ACCOUNT_ID][self.region]

    def _loopback_default_vpc(self) -> None:
        ec2, backend = self.client(), self._backend()
        for vpc in ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]:
            for subnet in ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc["VpcId"]]}])["Subnets"]:
                ec2.delete_subnet(SubnetId=subnet["SubnetId"])
            ec2.delete_vpc(VpcId=vpc["VpcId"])
        vpc = ec2.create_vpc(CidrBlock="127.20.0.0/16")["Vpc"]["VpcId"]
        backend.vpcs[vpc].is_default = True
        for i, zone in enumerate(z["ZoneName"] for z in ec2.describe_availability_zones()["AvailabilityZones"]):
            subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=f"127.20.{i}.0/24", AvailabilityZone=zone)["Subnet"]
            backend.get_subnet(subnet["SubnetId"]).default_for_az = True

    def _publish_gpu_image(self) -> None:
        name = DEFAULT_IMAGES["aws"].replace("*", " 20261201")
        image = self.client().register_image(Name=name, RootDeviceName="/dev/sda1", Architecture="x86_64")["ImageId"]
        self._backend().amis[image].owner_alias = "amazon"  # in the public catalog, as the real one is

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._sync()
            except Exception as err:  # the next poll tries again; a test sees the machines' logs
                print(f"emulated-aws: poll failed: {err}")

    def _sync(self) -> None:
        reservations = self.client().describe_instances()["Reservations"]
        alive = set()
        for item in (i for r in reservations for i in r["Instances"]):
            instance_id, state = item["InstanceId"], item["State"]["Name"]
            if state in ("pending", "running"):
                alive.add(instance_id)
                if instance_id not in self.runner.machines:
                    self._boot(instance_id, item)
        for instance_id in list(self.runner.machines):
            if instance_id not in alive:
                self.runner.stop(instance_id)
                stack = self._server_urls.pop(instance_id, None)
                if stack is not None:
                    stack.close()

    def _boot(self, instance_id: str, item: dict) -> None:
        attribute = self.client().describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
        user_data = base64.b64decode(attribute.get("UserData", {}).get("Value", "") or b"").decode()
        if not user_data.startswith("#!"):
            return  # not a replica of ours (a test's bare instance): nothing to boot
        metadata = AWSInstanceMetadata(instance_id, item["PrivateIpAddress"], item.get("PublicIpAddress"))
        stack = contextlib.ExitStack()
        server = stack.enter_context(serve(metadata.route))
        self._server_urls[instance_id] = stack
        self.metadata[instance_id] = metadata
        self.runner.start(instance_id, user_data, item["PrivateIpAddress"], server.url)

    # ---- what a test does to it --------------------------------------------------------------

    def preempt(self, instance_id: str, grace_s: float) -> float:
        """A spot interruption: the warning at the VM's IMDS now, the instance terminated at
        the deadline (as AWS does, behind the daemon's back)."""
        at = self.metadata[instance_id].preempt(grace_s)
        self.preempted.append(instance_id)
        timer = threading.Timer(grace_s, lambda: self._backend().terminate_instances([instance_id]))
        timer.daemon = True
        timer.start()
        return at

    def leftovers(self, service: str) -> dict[str, list[str]]:
        """What of the service is still in the cloud: instances, volumes, network interfaces,
        addresses and security groups. All empty once `spotctl down` is done."""
        ec2 = self.client()
        tagged = [{"Name": "tag:spot-orchestrator-service", "Values": [service]}]
        instances = [i["InstanceId"] for r in ec2.describe_instances(Filters=tagged)["Reservations"]
                     for i in r["Instances"] if i["State"]["Name"] not in ("terminated",)]
        volumes = [v["VolumeId"] for v in ec2.describe_volumes()["Volumes"]
                   if any(a.get("InstanceId") in instances for a in v.get("Attachments", []))]
        interfaces = [n["NetworkInterfaceId"] for n in ec2.describe_network_interfaces()["NetworkInterfaces"]
                      if (n.get("Attachment") or {}).get("InstanceId") in instances]
        addresses = [a.get("PublicIp", "") for a in ec2.describe_addresses()["Addresses"]]
        groups = [g["GroupId"] for g in ec2.describe_security_groups(Filters=tagged)["SecurityGroups"]]
        return {"instances": instances, "volumes": volumes, "network_interfaces": interfaces,
                "addresses": addresses, "security_groups": groups}

    def wait_machines(self, n: int, timeout_s: float = 120) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.runner.machines) >= n:
                return list(self.runner.machines)
            time.sleep(0.2)
        raise AssertionError(f"{n} machines did not boot in {timeout_s:.0f}s: {list(self.runner.machines)}")
