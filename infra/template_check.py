"""Offline check of ``template.yaml``: the SAM transform, then cfn-lint on the result.

``python -m infra.template_check [template.yaml]`` prints every problem and exits 1 if there
is one. No AWS account or network is used: the transform runs with a fixed region and an
empty managed-policy map (the template names managed policies by ARN), and cfn-lint runs on
the CloudFormation JSON the transform produced, with its bundled resource specs. A dangling
``Ref`` / ``GetAtt`` / ``Sub`` reference, an unknown property, a bad value: all are errors.
Warnings are reported but do not fail the check (informational rules such as I3042 are off).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REGION = "us-east-1"


@dataclass(frozen=True, slots=True)
class Problem:
    level: str  # "error" | "warning"
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.level} {self.rule}: {self.message}"


class _NoManagedPolicies:
    def load(self) -> dict[str, str]:
        return {}


def transform(template_text: str) -> tuple[dict[str, Any] | None, list[Problem]]:
    """The CloudFormation template SAM makes of ``template_text`` (None if it cannot)."""
    import boto3
    from samtranslator.model.exceptions import InvalidDocumentException
    from samtranslator.parser.parser import Parser
    from samtranslator.translator.translator import Translator
    from samtranslator.yaml_helper import yaml_parse

    try:
        template = yaml_parse(template_text)
    except Exception as exc:
        return None, [Problem("error", "yaml", str(exc))]
    _stand_in_code_uris(template)
    translator = Translator(
        _NoManagedPolicies().load(), Parser(), boto_session=boto3.Session(region_name=REGION)
    )
    try:
        out: dict[str, Any] = translator.translate(template, parameter_values={})
    except InvalidDocumentException as exc:
        return None, [Problem("error", "sam", str(cause)) for cause in exc.causes]
    return out, []


def _stand_in_code_uris(template: dict[str, Any]) -> None:
    """Local ``CodeUri`` paths (what ``sam build`` packages) as an S3 URI, as ``sam validate``
    does: the transform accepts only ``s3://`` locations."""
    stand_in = "s3://strata-template-check/code.zip"
    function_globals = (template.get("Globals") or {}).get("Function") or {}
    if isinstance(function_globals.get("CodeUri"), str):
        function_globals["CodeUri"] = stand_in
    for resource in (template.get("Resources") or {}).values():
        if isinstance(resource, dict) and resource.get("Type") == "AWS::Serverless::Function":
            properties = resource.setdefault("Properties", {})
            if isinstance(properties.get("CodeUri"), str) or (
                "CodeUri" not in properties and "CodeUri" in function_globals
            ):
                properties["CodeUri"] = stand_in


def lint(cloudformation: dict[str, Any]) -> list[Problem]:
    from cfnlint.api import ManualArgs
    from cfnlint.api import lint as cfn_lint

    matches = cfn_lint(
        json.dumps(cloudformation),
        config=ManualArgs(regions=[REGION], ignore_checks=["I"], include_checks=[]),
    )
    problems = []
    for match in matches:
        level = "error" if match.rule.id.startswith("E") else "warning"
        where = f"{'/'.join(str(p) for p in match.path)}" if match.path else ""
        problems.append(Problem(level, match.rule.id, f"{match.message} ({where})"))
    return problems


def check(template_text: str) -> list[Problem]:
    """Every problem with a template: the transform's, then cfn-lint's."""
    cloudformation, problems = transform(template_text)
    if cloudformation is None:
        return problems
    return problems + lint(cloudformation)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else ROOT / "template.yaml"
    problems = check(path.read_text())
    for problem in problems:
        print(f"{path}: {problem}")
    errors = [p for p in problems if p.level == "error"]
    print(f"{path}: {len(errors)} error(s), {len(problems) - len(errors)} warning(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
