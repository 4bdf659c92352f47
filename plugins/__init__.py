"""The UI plugin's code, installed as eagle3_airflow.plugins (plugins/eagle3_plugin.py is what Airflow's plugins
folder loads; .airflowignore keeps Airflow from loading the other files of this folder as plugins themselves)."""
