"""AWS Lambda handlers of the platform: pure Python plus boto3 (the Lambda runtime provides it)."""
