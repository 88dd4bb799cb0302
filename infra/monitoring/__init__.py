"""What an operator watches arenaflow with: Prometheus scrape configurations (`scrape`),
alert rules and their tests (`alerts.yml`, `alerts_test.yml`), the Grafana dashboard
(`dashboard`, generated into `grafana/arenaflow.json`) and `arena top` (`top`)."""
