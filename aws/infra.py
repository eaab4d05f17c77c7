"""Check, and create when missing, what one host needs: a bucket, an instance role, a security group.

Every function is idempotent: it reads first and creates or changes only what is missing or
different, appending a line per change to ``created`` (a second call appends nothing).

- bucket: default encryption (SSE-S3) and every public-access block on;
- role and instance profile: trusted by EC2, ``AmazonSSMManagedInstanceCore`` attached, and an
  inline policy that reaches this bucket only;
- security group in the region's default VPC with no ingress rules (SSM needs outbound only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from botocore.exceptions import ClientError

from hobson.aws.clients import error_code
from hobson.errors import ConfigError, HobsonError

SSM_CORE = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"
BUCKET_POLICY_NAME = "hobson-bucket"
EC2_TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}
PUBLIC_BLOCK = {"BlockPublicAcls": True, "IgnorePublicAcls": True, "BlockPublicPolicy": True,
                "RestrictPublicBuckets": True}


@dataclass
class Infra:
    bucket: str
    bucket_region: str
    instance_profile: str
    security_groups: dict[str, str] = field(default_factory=dict)  # region -> group id
    created: list[str] = field(default_factory=list)


def bucket_policy(bucket: str) -> dict:
    """The host may read and write this bucket and nothing else in S3."""
    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"], "Resource": f"arn:aws:s3:::{bucket}"},
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"],
         "Resource": f"arn:aws:s3:::{bucket}/*"}]}


def ensure_bucket(s3, bucket: str, region: str, tags: dict[str, str], created: list[str]) -> None:
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError as e:
        code = error_code(e)
        if code in ("403", "AccessDenied"):
            raise HobsonError(f"bucket {bucket} exists but is not readable with these credentials (another "
                              "account owns the name?); set `bucket:` in configs/aws.yaml") from None
        if code not in ("404", "NoSuchBucket", "NotFound"):
            raise
        kwargs = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        s3.create_bucket(Bucket=bucket, **kwargs)
        s3.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": [{"Key": k, "Value": v} for k, v in tags.items()]})
        created.append(f"s3 bucket {bucket} ({region})")
    try:
        rules = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
    except ClientError as e:
        if error_code(e) != "ServerSideEncryptionConfigurationNotFoundError":
            raise
        rules = []
    if not rules:
        s3.put_bucket_encryption(Bucket=bucket, ServerSideEncryptionConfiguration={"Rules": [
            {"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]})
        created.append(f"s3 bucket {bucket}: default encryption AES256")
    try:
        block = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    except ClientError as e:
        if error_code(e) != "NoSuchPublicAccessBlockConfiguration":
            raise
        block = {}
    if any(block.get(k) is not True for k in PUBLIC_BLOCK):
        s3.put_public_access_block(Bucket=bucket, PublicAccessBlockConfiguration=PUBLIC_BLOCK)
        created.append(f"s3 bucket {bucket}: public access blocked")


def _exists(call, missing: str = "NoSuchEntity", **kwargs) -> dict | None:
    try:
        return call(**kwargs)
    except ClientError as e:
        if error_code(e) == missing:
            return None
        raise


def ensure_role(iam, role: str, bucket: str, tags: dict[str, str], created: list[str]) -> str:
    """The role and its same-named instance profile; returns the profile name."""
    tag_list = [{"Key": k, "Value": v} for k, v in tags.items()]
    if _exists(iam.get_role, RoleName=role) is None:
        iam.create_role(RoleName=role, AssumeRolePolicyDocument=json.dumps(EC2_TRUST), Tags=tag_list,
                        Description="hobson GPU host: SSM agent and its run bucket only")
        created.append(f"iam role {role}")
    attached = iam.list_attached_role_policies(RoleName=role).get("AttachedPolicies", [])
    if SSM_CORE not in {p["PolicyArn"] for p in attached}:
        iam.attach_role_policy(RoleName=role, PolicyArn=SSM_CORE)
        created.append(f"iam role {role}: AmazonSSMManagedInstanceCore attached")
    want = bucket_policy(bucket)
    have = _exists(iam.get_role_policy, RoleName=role, PolicyName=BUCKET_POLICY_NAME)
    doc = have.get("PolicyDocument") if have else None
    if isinstance(doc, str):
        doc = json.loads(doc)
    if doc != want:
        iam.put_role_policy(RoleName=role, PolicyName=BUCKET_POLICY_NAME, PolicyDocument=json.dumps(want))
        created.append(f"iam role {role}: policy {BUCKET_POLICY_NAME} for s3://{bucket} only")
    prof = _exists(iam.get_instance_profile, InstanceProfileName=role)
    if prof is None:
        iam.create_instance_profile(InstanceProfileName=role, Tags=tag_list)
        created.append(f"iam instance profile {role}")
        roles = []
    else:
        roles = [r["RoleName"] for r in prof["InstanceProfile"].get("Roles", [])]
    if role not in roles:
        iam.add_role_to_instance_profile(InstanceProfileName=role, RoleName=role)
        created.append(f"iam instance profile {role}: role added")
    return role


def ensure_security_group(ec2, name: str, region: str, tags: dict[str, str], created: list[str]) -> str:
    vpcs = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}]).get("Vpcs", [])
    if not vpcs:
        raise ConfigError(f"{region} has no default VPC; create one (aws ec2 create-default-vpc) or drop the "
                          "region from configs/aws.yaml")
    vpc = vpcs[0]["VpcId"]
    groups = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": [name]},
                                                   {"Name": "vpc-id", "Values": [vpc]}]).get("SecurityGroups", [])
    if groups:
        g = groups[0]
        if g.get("IpPermissions"):
            raise HobsonError(f"security group {name} ({g['GroupId']}, {region}) has ingress rules; this tool uses "
                              "a group with none. Remove them or set another `security_group:` name")
        return g["GroupId"]
    gid = ec2.create_security_group(
        GroupName=name, Description="hobson GPU host: no ingress (driven over SSM)", VpcId=vpc,
        TagSpecifications=[{"ResourceType": "security-group",
                            "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}])["GroupId"]
    created.append(f"security group {name} {gid} ({region}, {vpc}, no ingress)")
    return gid
